"""The resolved config as small frozen settings, one per part: each part is given its own and never the config.

Built once at construction from the trainer's resolved copy of the config (parts/resolved_config.py); nothing here
changes afterwards. A flag's config name is read here (or by the config's own resolver, config_utils) and nowhere
else, so a renamed field (transformers' `activation_checkpointing`) is followed in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..generation.sampling import TRANSFORMERS, VLLM_COLOCATE, VLLM_SERVER
from ..losses.token_logprobs import chunk_rows_for
from ..models.checkpointing import checkpointing_setting
from ..planning.recommend import micro_batch_group


@dataclass(frozen=True)
class Checkpointing:
    """Activation (gradient) checkpointing, whichever name transformers reads: on or off, reentrant or not.

    On, the model's cache is off (`use_cache=False`) and a PEFT model's frozen embeddings give outputs that require
    grad (`enable_input_require_grads`), without which reentrant checkpointing trains no adapter."""

    enabled: bool
    kwargs: dict = field(default_factory=dict)

    @property
    def reentrant(self) -> bool:
        return bool(self.enabled and self.kwargs.get("use_reentrant", True))  # torch's default is reentrant


def checkpointing_of(args) -> Checkpointing:
    enabled, kwargs = checkpointing_setting(args)  # after config_utils.resolve_checkpointing, under either name
    return Checkpointing(enabled, dict(kwargs or {}))


@dataclass(frozen=True)
class Layout:
    """How rows are laid out (data/collators.py, data/packing.py): padding-free rows, packed training (and eval)
    splits, the length a batch pads to a multiple of, an online run's shared-prompt rows (a group's prompt once: as
    the config resolved it, then as the loaded model allows, reference.py). Known before the models load: loading
    reads it."""

    padding_free: bool
    packing: bool = False
    eval_packing: bool | None = None  # None: as training
    pad_to_multiple_of: int | None = None
    shared_prompt: bool = False

    def packs(self, split: str) -> bool:
        """Whether a split ("train", "eval", "eval_<name>") is packed."""
        return self.packing if split == "train" or self.eval_packing is None else self.eval_packing


def layout_of(args) -> Layout:
    """The config's layout (packing is SFT's and GKD's only, shared-prompt rows the online methods')."""
    return Layout(args.padding_free, bool(getattr(args, "packing", False)), getattr(args, "eval_packing", None),
                  args.pad_to_multiple_of, bool(getattr(args, "shared_prompt", False)))


@dataclass(frozen=True)
class NonFiniteSettings:
    """What the NaN/inf guard (step_guards.py) decides by: stop or skip, where a stop's report goes, the processes."""

    policy: str  # "stop" | "skip"
    output_dir: str | None
    world_size: int
    device: torch.device


@dataclass(frozen=True)
class StepLossSettings:
    """How a step's loss is divided (base.py's StepLoss): by the items of all processes when they average together;
    `router_aux_loss_coef`: the MoE router loss's weight set in the config (None: the model config's own)."""

    average_tokens_across_devices: bool
    world_size: int
    router_aux_loss_coef: float | None


@dataclass(frozen=True)
class Offloading:
    """Activation offloading (memory/offloading.py): saved activations of the forward pass kept in CPU memory."""

    enabled: bool
    min_bytes: int
    use_streams: bool


@dataclass(frozen=True)
class HeadSettings:
    """The log-prob engine's (parts/logprob_engine.py): the device its path runs on, the head's chunk (the user's
    `loss_chunk_size`, else the rule's from the device's free memory, read once here), offloading, and under Liger
    which head computes the loss (`liger_head`: auto, liger or chunked; losses/head_choice.py)."""

    device_type: str
    loss_chunk_size: int | None
    offloading: Offloading
    free_memory_bytes: int | None = None  # a CUDA device's free memory when the settings were resolved
    liger_head: str = "auto"

    def chunk_rows(self, vocab_size: int) -> int:
        """The chunked head's rows per chunk: the user's, else losses/token_logprobs.py's `chunk_rows_for`."""
        return self.loss_chunk_size or chunk_rows_for(vocab_size, self.device_type, self.free_memory_bytes)


@dataclass(frozen=True)
class BatchSettings:
    """The out-of-memory retry's (parts/step_guards.py): the micro-batch and accumulation a run starts with, its
    processes, an online run's generation round and prompt groups (rows per group, examples per row)."""

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    steps_per_generation: int | None = None
    group: int = 1
    per_row: int = 1


@dataclass(frozen=True)
class ReferenceSettings:
    """The reference's (reference.py): log-probs computed once before training (their batch, else the training
    micro-batch), TR-DPO's sync (every `sync_steps` steps, by `mixup_alpha`)."""

    batch_size: int
    precompute: bool = False
    precompute_batch_size: int | None = None
    sync: bool = False
    sync_steps: int | None = None
    mixup_alpha: float | None = None


@dataclass(frozen=True)
class RoundReportSettings:
    """What an online round reports (metrics/run_metrics.py's `RoundMetrics`): its groups' sizes in training and evaluation, how many
    completions a log shows, the completion budget an over-long rollout is named against."""

    num_generations: int
    eval_num_generations: int
    num_completions_to_print: int | None
    max_completion_length: int | None


@dataclass(frozen=True)
class TrainerSettings:
    """Every part's settings, resolved once from the trainer's config; `device`: the run's (run metrics')."""

    device: torch.device
    layout: Layout
    checkpointing: Checkpointing
    nonfinite: NonFiniteSettings
    step_loss: StepLossSettings
    head: HeadSettings
    batch: BatchSettings
    reference: ReferenceSettings
    round_report: RoundReportSettings | None = None  # the online trainers'


def resolve_settings(args, online: bool, layout: Layout) -> TrainerSettings:
    """The parts' settings from the trainer's resolved config (after Trainer's set-up: `device` and `world_size`
    are the accelerator's); `online`: the trainer generates rounds (its micro-batches are of whole prompt groups)."""
    group, per_row = online_group(args) if online else (1, 1)
    return TrainerSettings(
        device=args.device,
        layout=layout,
        checkpointing=checkpointing_of(args),
        nonfinite=NonFiniteSettings(args.nonfinite_policy, args.output_dir, args.world_size, args.device),
        step_loss=StepLossSettings(args.average_tokens_across_devices, args.world_size,
                                   getattr(args, "router_aux_loss_coef", None)),
        head=HeadSettings(args.device.type, args.loss_chunk_size,
                          Offloading(args.activation_offloading, args.activation_offloading_min_bytes,
                                     args.activation_offloading_use_streams), free_memory_of(args.device),
                          getattr(args, "liger_head", "auto")),
        batch=BatchSettings(args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size,
                            getattr(args, "steps_per_generation", None) if online else None, group, per_row),
        reference=reference_of(args),
        round_report=RoundReportSettings(args.num_generations, args.eval_num_generations,
                                         args.num_completions_to_print, args.max_completion_length) if online else None,
    )


def free_memory_of(device: torch.device) -> int | None:
    """A CUDA device's free memory now (the models already on it), for the head's chunk rule; None elsewhere."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def reference_of(args) -> ReferenceSettings:
    """The reference's settings (DPO, KTO and the online configs have them; the others: none precomputed, no sync)."""
    return ReferenceSettings(args.per_device_train_batch_size, bool(getattr(args, "precompute_ref_log_probs", False)),
                             getattr(args, "precompute_ref_batch_size", None),
                             bool(getattr(args, "sync_ref_model", False)), getattr(args, "ref_model_sync_steps", None),
                             getattr(args, "ref_model_mixup_alpha", None))


def online_group(args) -> tuple[int, int]:
    """(rows of per_device_train_batch_size in one prompt group, completions per row: Online DPO's rows are
    prompts of two)."""
    completions, steps = args.generation_plan(1)
    return micro_batch_group(args), max(1, completions // (args.per_device_train_batch_size * steps))


@dataclass(frozen=True)
class TiledMlpSettings:
    """The sequence-tiled MLP's (memory/tiled_mlp.py): on or off, and the tokens per tile (None: from its rule,
    `tile_tokens`, against the device's free memory)."""

    enabled: bool
    tile_size: int | None = None
    attention_projections: bool = False  # the norms and attention projections too, at the same tile


def tiled_mlp_of(args) -> TiledMlpSettings:
    return TiledMlpSettings(bool(getattr(args, "tiled_mlp", False)), getattr(args, "tiled_mlp_tile_size", None),
                            bool(getattr(args, "tiled_attention_projections", False)))


@dataclass(frozen=True)
class OptimizerInBackwardSettings:
    """The optimizer step inside the backward's (parts/optimizer_in_backward.py): on or off (the config refused what
    it cannot do: clipping, DeepSpeed, FSDP, fp16, nonfinite_policy='skip')."""

    enabled: bool


def optimizer_in_backward_of(args) -> OptimizerInBackwardSettings:
    return OptimizerInBackwardSettings(bool(getattr(args, "optimizer_in_backward", False)))



def generation_engine(args) -> str:
    """Which backend generates (generation/backend.py's names): the one place `use_vllm` and `vllm_mode` are read."""
    if not args.use_vllm:
        return TRANSFORMERS
    if args.vllm_mode == "colocate":
        return VLLM_COLOCATE
    if args.vllm_mode == "server":
        return VLLM_SERVER
    raise ValueError(f"`vllm_mode` must be 'colocate' or 'server', got {args.vllm_mode!r}.")

@dataclass(frozen=True)
class GenerationSettings:
    """The generation session's (generation/sampling.py): the engine that samples (its engine names), the seed each
    round's seed is drawn from, vLLM's own context limit (None: the model's), transformers' KV cache as the config
    asks (`cache_implementation`, None: resolved by generation/transformers_backend.py)."""

    engine: str
    seed: int
    vllm_max_model_length: int | None = None
    cache_implementation: str | None = None


def generation_of(args) -> GenerationSettings:
    """An online config's generation settings (GKD's generate with transformers: `generation_engine` reads False)."""
    return GenerationSettings(generation_engine(args), args.seed, getattr(args, "vllm_max_model_length", None),
                              getattr(args, "cache_implementation", None))


@dataclass(frozen=True)
class RoundSettings:
    """The round builder's (online/round_builder.py): the completions per prompt, a round's reuse
    (`num_iterations`) and whether it trains after the policy moved (`off_policy`), what its micro-batches mask and
    log, and their layout (one shared-prompt row per micro-batch, or the collator's padding-free / padded rows)."""

    num_generations: int
    num_iterations: int
    off_policy: bool
    mask_truncated_completions: bool
    log_completions: bool
    shared_prompt: bool
    padding_free: bool
    pad_to_multiple_of: int | None


def round_settings_of(args, steps_per_generation: int, layout: Layout) -> RoundSettings:
    """A round is scored with the generation-time policy when it trains after the policy moved: over more optimizer
    steps than one, or more than once. `layout`: the trainer's, after its models loaded."""
    off_policy = steps_per_generation > args.gradient_accumulation_steps or args.num_iterations > 1
    return RoundSettings(args.num_generations, args.num_iterations, off_policy, args.mask_truncated_completions,
                         args.log_completions, layout.shared_prompt, layout.padding_free, layout.pad_to_multiple_of)


@dataclass(frozen=True)
class CheckpointOffloadSettings:
    """Checkpoint offload's (memory/checkpoint_offload.py): how many of the first decoder layers' checkpointed inputs
    go to host memory (0: off), or `auto` (counted from the first input's size against the host's available memory);
    `host_limit_bytes`: the host memory it may hold (None: the host's available memory when it copies)."""

    layers: int = 0
    auto: bool = False
    host_limit_bytes: int | None = None

    @property
    def enabled(self) -> bool:
        return self.auto or self.layers != 0  # -k: all but the last k


def checkpoint_offload_of(args) -> CheckpointOffloadSettings:
    value = getattr(args, "checkpoint_offload_layers", None)  # validated (memory_options.py): None, int >= 0, "auto"
    return CheckpointOffloadSettings(0 if value in (None, "auto") else int(value), value == "auto")
