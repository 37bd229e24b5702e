"""Fields every online trainer (GRPO, RLOO) shares: prompts, generation, the backends, the clipped objective.

TRL's names and meanings, so a TRL script moves over by changing its imports; leantune adds the memory engine's
fields (MemoryOptions), `padding_free` scoring and the older `max_prompt_length`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments
from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

from ..generation.backend import TRANSFORMERS
from .config_utils import (
    non_default,
    positive_or_none,
    requested_cp_size,
    resolve_pad_to_multiple_of,
    resolve_shared_settings,
    validate_shared_options,
)
from .memory_options import MemoryOptions
from .online.shared_prompt import BY_DEFAULT, nothing_to_share
from .settings import generation_engine
from .trl_options import CausalLMOptions, ReferenceSyncOptions

logger = logging.getLogger("leantune.trainer")

VLLM_MODES = ("colocate", "server")
# Options read only by one vLLM mode (generation/vllm_colocate.py, generation/vllm_client.py).
VLLM_COLOCATE_OPTIONS = ("vllm_enable_sleep_mode", "vllm_gpu_memory_utilization", "vllm_max_model_length",
                         "vllm_tensor_parallel_size")
VLLM_SERVER_OPTIONS = ("vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
                       "vllm_server_request_timeout")


@dataclass
class OnlineConfig(MemoryOptions, CausalLMOptions, ReferenceSyncOptions, TrainingArguments):
    min_num_generations = 2  # a group's baseline needs two; PPO's baseline is its value function (1)
    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})
    logging_steps: float = field(default=10, metadata={"help": "Log every N optimizer steps."})

    # Model
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Keyword arguments for from_pretrained when `model` is a string."}
    )
    disable_dropout: bool = field(default=False, metadata={"help": "Turn dropout off in the policy and reference."})

    # Prompts and scoring batches
    max_prompt_length: int | None = field(
        default=None,
        metadata={"help": "Keep at most this many prompt tokens (the end of the prompt); cut prompts are counted."},
    )
    shuffle_dataset: bool = field(default=True, metadata={
        "help": "Shuffle the prompts (a stream: a seeded shuffle buffer of 1000 rows, as in TRL)."})
    padding_free: bool = field(
        default=False,
        metadata={"help": "Score the completions of a batch in one row with restarting position_ids (no padding)."},
    )
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Pad each scored batch to a multiple of this."})
    shared_prompt: bool | None = field(
        default=None,
        metadata={"nargs": "?", "const": True, "help": "Score each group's prompt once: one row per group [prompt, completion_1, ..., completion_G], "
                  "each completion attending to that one prompt (one attention call per layer; the prompt's gradients "
                  "summed over the G completions), in the policy, reference and old-policy forwards. Same log-probs, "
                  "losses and gradients as scoring every completion with its own prompt copy, with less compute and "
                  "activation memory. Default (None): on where a micro-batch holds completions of one prompt to "
                  "share (GRPO, RLOO, Online DPO with an sdpa model), off otherwise, said in the log. Needs "
                  "attn_implementation='sdpa' (leantune's segment attention)."},
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Extra arguments of the chat template for conversational prompts."}
    )

    # Generation
    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt (a group)."})
    num_generations_eval: int | None = field(
        default=None, metadata={"help": "Completions per prompt in evaluation (default: num_generations)."}
    )
    max_completion_length: int = field(default=512, metadata={"help": "Most tokens of a completion."})
    generation_batch_size: int | None = field(
        default=None,
        metadata={"help": "Completions generated per round, over all processes "
                  "(default: per_device_train_batch_size x processes x steps_per_generation)."},
    )
    steps_per_generation: int | None = field(
        default=None, metadata={"help": "Micro-batches trained per generation round (default: gradient_accumulation_steps)."}
    )
    max_completions_per_generate: int | None = field(
        default=None,
        metadata={"help": "leantune's own: at most this many completions per `generate` call on each process (a "
                  "multiple of num_generations: whole prompt groups); a larger round is generated in pieces, which "
                  "bounds transformers' KV cache. The round, its groups and the global batch stay as they are; the "
                  "pieces continue the round's seeded sampling stream, so their completions follow the same "
                  "distribution but are not token for token those of one call. Default: the round in one call."},
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (also applied when scoring)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling: keep the smallest set of this probability."})
    top_k: int = field(default=0, metadata={"help": "Keep the k most likely tokens (0: all)."})
    min_p: float | None = field(default=None, metadata={"help": "Drop tokens below min_p x the top probability."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Penalty on tokens already present (1: none)."})
    generation_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Further sampling arguments passed to the backend as they are."}
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={"help": "Under DeepSpeed ZeRO-3, gather the sharded weights once per generation round (fast); "
                  "False generates with sharded weights (slower, never holds the whole model on one GPU)."},
    )

    # vLLM
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM (needs leantune[vllm] and CUDA)."})
    vllm_mode: str = field(
        default="colocate",
        metadata={"help": "colocate: the engine runs in the training process; server: a `leantune vllm-serve` process."},
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={"help": "Colocate: the engine gives its weights and KV cache back during optimisation steps."},
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "Colocate: share of GPU memory the engine may take."}
    )
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "Engine context length (default: model's)."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "Colocate: tensor-parallel size of the engine."})
    vllm_server_base_url: str | None = field(
        default=None, metadata={"help": "Server: its base URL (overrides host and port)."}
    )
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "Server: host."})
    vllm_server_port: int = field(default=8000, metadata={"help": "Server: port."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "Server: seconds to wait for it to answer."})
    vllm_server_request_timeout: float = field(
        default=1800.0, metadata={"help": "Server: seconds one request (a generation round, a weight chunk) may take."}
    )

    # Objective
    beta: float = field(default=0.0, metadata={"help": "KL coefficient; 0 loads no reference model."})
    num_iterations: int = field(default=1, metadata={"help": "Optimisation passes over each generation round."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping range of the probability ratio."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clipping range (default: epsilon)."})
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weight of each reward function (default: 1 each)."}
    )
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Completions cut at max_completion_length (no EOS) get no loss."}
    )
    log_completions: bool = field(default=False, metadata={"help": "Log a few prompts, completions and rewards."})
    num_completions_to_print: int | None = field(default=None, metadata={"help": "How many (default: 4)."})
    log_multimodal: bool = field(
        default=True, metadata={"help": "Log images and other media with completions (no effect: text only)."}
    )

    cache_implementation: str | None = field(
        default=None, metadata={"help": "KV cache of transformers' generate ('static', 'dynamic', ...). Default: "
                                "'static' on a CUDA device (transformers compiles its decode step), else the model's "
                                "own cache."}
    )

    # TRL fields leantune does not implement yet: a value other than the default is refused (config_utils.py).
    log_unique_prompts: bool = field(default=False, metadata={"help": "Log each prompt once. Not supported yet."})
    vllm_model_impl: str = field(
        default="vllm", metadata={"help": "vLLM's model code: vllm or transformers. Not supported yet (vllm)."}
    )
    vllm_structured_outputs_regex: str | None = field(
        default=None, metadata={"help": "Constrain vLLM's completions to a regular expression. Not supported yet."}
    )
    vllm_group_port: int = field(
        default=51216, metadata={"help": "Server: port of TRL's weight-update group. Not needed by leantune's server."}
    )
    use_transformers_continuous_batching: bool = field(
        default=False, metadata={"help": "Generate with transformers' continuous batching. Not supported yet."}
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None, metadata={"help": "Settings of that continuous batching. Not supported yet."}
    )
    use_transformers_paged: bool = field(
        default=False, metadata={"help": "Older name of use_transformers_continuous_batching. Not supported yet."}
    )

    def __post_init__(self):
        resolve_shared_settings(self)
        for name in ("generation_kwargs", "chat_template_kwargs"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, json.loads(value))
        super().__post_init__()
        validate_online_config(self)
        resolve_pad_to_multiple_of(self)  # context parallelism: 2 x cp_size, as SFT's

    @property
    def upper_epsilon(self) -> float:
        """`epsilon_high`, or `epsilon` while it is unset (kept unset, so a later change of `epsilon` follows)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def eval_num_generations(self) -> int:
        """`num_generations_eval`, or `num_generations` while it is unset."""
        return self.num_generations if self.num_generations_eval is None else self.num_generations_eval

    def generation_plan(self, world_size: int) -> tuple[int, int]:
        """(completions generated per round over all processes, micro-batches trained per round per process)."""
        per_step = self.per_device_train_batch_size * world_size
        if self.generation_batch_size is None:
            steps = self.steps_per_generation or self.gradient_accumulation_steps
            return per_step * steps, steps
        if self.generation_batch_size % per_step:
            raise ValueError(f"`generation_batch_size` ({self.generation_batch_size}) must be a multiple of "
                             f"`per_device_train_batch_size` x processes ({per_step}); change either.")
        return self.generation_batch_size, self.generation_batch_size // per_step


def validate_online_config(args: OnlineConfig) -> None:
    validate_shared_options(args)
    if args.generation_batch_size is not None and args.steps_per_generation is not None:
        raise ValueError("Set `generation_batch_size` or `steps_per_generation`, not both: each determines the other.")
    for name in ("max_prompt_length", "pad_to_multiple_of", "generation_batch_size", "steps_per_generation",
                 "vllm_max_model_length", "max_completions_per_generate"):
        positive_or_none(getattr(args, name), name)
    for name in ("num_generations", "num_generations_eval", "max_completion_length", "num_iterations",
                 "vllm_tensor_parallel_size"):
        positive_or_none(getattr(args, name), name)
    if args.cache_implementation is not None and args.cache_implementation not in ALL_CACHE_IMPLEMENTATIONS:
        raise ValueError(f"`cache_implementation` must be one of transformers' {list(ALL_CACHE_IMPLEMENTATIONS)} "
                         f"or None, got {args.cache_implementation!r}.")
    if args.num_generations < args.min_num_generations:
        raise ValueError(f"`num_generations` must be at least 2 (a group needs a baseline), got {args.num_generations}.")
    if args.temperature <= 0:
        raise ValueError(f"`temperature` must be positive, got {args.temperature}.")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"`top_p` must be in (0, 1], got {args.top_p}.")
    if args.top_k < 0:
        raise ValueError(f"`top_k` must be >= 0, got {args.top_k}.")
    if any(beta < 0 for beta in (args.beta if isinstance(args.beta, list) else [args.beta])):
        raise ValueError(f"`beta` must be >= 0, got {args.beta}.")
    if args.epsilon < 0 or args.upper_epsilon < 0:
        raise ValueError("`epsilon` and `epsilon_high` must be >= 0.")
    if args.vllm_mode not in VLLM_MODES:
        raise ValueError(f"`vllm_mode` must be one of {VLLM_MODES}, got {args.vllm_mode!r}.")
    if not 0 < args.vllm_gpu_memory_utilization <= 1:
        raise ValueError(f"`vllm_gpu_memory_utilization` must be in (0, 1], got {args.vllm_gpu_memory_utilization}.")
    validate_vllm_options(args)
    if args.generation_batch_size is not None and args.generation_batch_size % args.num_generations:
        raise ValueError(f"`generation_batch_size` ({args.generation_batch_size}) must be a multiple of "
                         f"`num_generations` ({args.num_generations}).")
    if args.max_completions_per_generate is not None and args.max_completions_per_generate % args.num_generations:
        raise ValueError(f"`max_completions_per_generate` ({args.max_completions_per_generate}) must be a multiple of "
                         f"`num_generations` ({args.num_generations}): each generate call takes whole prompt groups.")
    # Rounds over all processes (TRL checks the same at construction): every group must be whole.
    round_size, _ = args.generation_plan(args.world_size // requested_cp_size(args))  # a cp group: one share
    if round_size % args.num_generations:
        raise ValueError(f"Completions per generation round ({round_size} = `per_device_train_batch_size` x "
                         f"{args.world_size} processes x `steps_per_generation`, default `gradient_accumulation_steps`)"
                         f" must be a multiple of num_generations ({args.num_generations}); change one of them or "
                         f"`num_generations`.")
    resolve_shared_prompt(args)  # the default: on where it has something to share, else off (logged)
    if args.num_completions_to_print is not None and not args.log_completions:
        raise ValueError("`num_completions_to_print` has no effect without `log_completions=True`; set "
                         "`log_completions=True` or leave `num_completions_to_print` unset.")


def resolve_shared_prompt(args) -> None:
    """`shared_prompt`'s default (None), resolved once when the config is built: on where a micro-batch holds several
    completions of one prompt, else off with one log line. An explicit False or True is kept; an explicit True
    without groups (PPO: one completion per prompt) is refused."""
    requested = args.shared_prompt
    if requested is not None:
        if requested and getattr(args, "min_num_generations", 2) < 2:
            raise ValueError("`shared_prompt=True` is for methods that sample groups of completions per prompt "
                             "(GRPO, RLOO, Online DPO); set `shared_prompt=False`.")
        setattr(args, BY_DEFAULT, False)
        return
    reason = nothing_to_share(args)
    args.shared_prompt = reason is None
    setattr(args, BY_DEFAULT, args.shared_prompt)
    if reason is not None:
        logger.info("shared_prompt: off for this run (%s).", reason)


def validate_vllm_options(args: OnlineConfig) -> None:
    """vLLM options set where nothing reads them: without `use_vllm`, or for the other `vllm_mode`."""
    if generation_engine(args) == TRANSFORMERS:
        for name in non_default(args, "vllm_mode", *VLLM_COLOCATE_OPTIONS, *VLLM_SERVER_OPTIONS):
            raise ValueError(f"`{name}` has no effect without `use_vllm=True` (completions come from transformers' "
                             f"generate); set `use_vllm=True` or leave `{name}` at its default.")
        return
    if args.cache_implementation is not None:
        raise ValueError("`cache_implementation` is the KV cache of transformers' generate; vLLM keeps its own. Leave "
                         "it unset with `use_vllm=True`.")
    if args.max_completions_per_generate is not None:
        raise ValueError("`max_completions_per_generate` bounds transformers' generate (its KV cache grows with the "
                         "sequences of a call); vLLM reserves its pool at start whatever a call holds. Leave it unset "
                         "with `use_vllm=True`, or lower `vllm_gpu_memory_utilization`.")
    other = "server" if args.vllm_mode == "colocate" else "colocate"
    options = VLLM_SERVER_OPTIONS if args.vllm_mode == "colocate" else VLLM_COLOCATE_OPTIONS
    for name in non_default(args, *options):
        raise ValueError(f"`{name}` applies to `vllm_mode='{other}'`, not to {args.vllm_mode!r}; set "
                         f"`vllm_mode='{other}'` or leave `{name}` at its default.")
    if not args.ds3_gather_for_generation:
        raise ValueError("`ds3_gather_for_generation=False` applies to transformers' generate, not to vLLM (whose "
                         "weights are synced a module at a time under ZeRO-3); set `ds3_gather_for_generation=True` "
                         "or `use_vllm=False`.")
    if (args.vllm_mode == "colocate" and args.vllm_max_model_length is not None
            and args.max_completion_length >= args.vllm_max_model_length):
        raise ValueError(f"`max_completion_length` ({args.max_completion_length}) leaves no room for a prompt in "
                         f"`vllm_max_model_length` ({args.vllm_max_model_length}); raise `vllm_max_model_length` or "
                         f"lower `max_completion_length`.")
