"""Config fields of the memory engine, shared by every leantune config (TRL's names where TRL has them).

It comes before TrainingArguments in each config's bases, so its defaults for transformers' own fields
(`gradient_checkpointing`: True as in TRL; `bf16`: None = decided in __post_init__ by config_utils) take precedence."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..losses.head_choice import HEAD_CHOICES
from ..memory.checkpoint_offload import unsupported_by_transformers
from ..metrics.devices import parse_budget
from ..models.checkpointing import checkpointing_setting
from .config_fields import non_default


@dataclass
class MemoryOptions:
    gradient_checkpointing: bool | None = field(
        default=True,
        metadata={"help": "Recompute activations in the backward pass to save memory (non-reentrant). True, as in TRL; "
                  "transformers' newer `activation_checkpointing`, when set, takes precedence."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={"help": "bf16 mixed precision. Default: on when a bf16-capable GPU is used and fp16 is off."},
    )
    chunked_loss: bool = field(
        default=True,
        metadata={"help": "Log-probs from hidden states, a chunk of target tokens at a time, never the full logits "
                  "(exact). False: the model computes [tokens, vocabulary] logits."},
    )
    use_liger_loss: bool = field(
        default=False,
        metadata={"help": "Never hold the full logits: liger-kernel's fused losses on CUDA (on CPU with TRITON_INTERPRET=1), else leantune's chunked loss."},
    )
    activation_offloading: bool = field(
        default=False,
        metadata={"help": "Move saved activations to (pinned) CPU memory in the forward pass, back for the backward."},
    )
    activation_offloading_use_streams: bool = field(
        default=True, metadata={"help": "Overlap offloading copies with compute on separate CUDA streams."}
    )
    activation_offloading_min_bytes: int = field(
        default=1 << 20, metadata={"help": "Saved tensors smaller than this stay on the device."}
    )
    loss_chunk_size: int | None = field(
        default=None,
        metadata={"help": "Tokens per chunk of the chunked loss (default: a 64 MiB fp32 chunk of logits)."},
    )
    memory_breakdown: bool = field(
        default=True,
        metadata={"help": "Measure one training step's peak memory and its parts (parameters, gradients, ...) and log them."},
    )
    nonfinite_policy: str = field(
        default="stop",
        metadata={"help": "A NaN or inf loss or gradient in an optimizer step: 'stop' (an error naming the step, its "
                  "train rows and the last good checkpoint) or 'skip' (no optimizer update for that step; skipped "
                  "steps are logged with their rows and counted)."},
    )
    plan_check: bool = field(
        default=False,
        metadata={"help": "Before training, plan the run's step peak (leantune plan, fake weights) and warn when it "
                  "exceeds the training device's free memory."},
    )
    memory_budget: str | None = field(
        default=None,
        metadata={"help": "Size the run to this memory before its weights load: 24GiB, 1500MiB, a GPU name (h100, "
                  "l4, ...) or auto (the CUDA device's free memory). The plan (leantune plan) picks the fastest "
                  "configuration that fits and learns the same thing, and the log says what it changed."},
    )
    tiled_mlp: bool = field(
        default=False,
        metadata={"help": "Run each decoder layer's MLP over tiles of the sequence, in the forward and the backward's "
                  "recompute, never holding [tokens, intermediate] at once (exact; per-token, so any row layout)."},
    )
    tiled_mlp_tile_size: int | None = field(
        default=None,
        metadata={"help": "Tokens per tile of `tiled_mlp` (default: from the plan, a share of the device's free "
                  "memory, never below 1,024 tokens on a GPU)."},
    )
    optimizer_in_backward: bool = field(
        default=False,
        metadata={"help": "Step the optimizer inside the backward pass: one optimizer per parameter, each stepped and "
                  "its gradient freed as soon as that gradient is complete (on the last micro-batch of a step), so "
                  "the step never holds every gradient at once. Exact; needs max_grad_norm=0 (no clipping), one "
                  "process, no DeepSpeed or FSDP."},
    )
    checkpoint_offload_layers: int | str | None = field(
        default=None,
        metadata={"help": "Move the inputs gradient checkpointing keeps of the first N decoder layers to pinned host "
                  "memory (side CUDA stream, the previous layer's fetched ahead in the backward; exact). An int N "
                  "(-k: all but the last k), "
                  "'auto' (as many as the host's available memory holds, or with memory_budget the plan's fewest that "
                  "fit) or None/0 (off). Needs gradient checkpointing; a run the host cannot hold is refused."},
    )
    # Why a number of layers and not a switch: the host bounds it (the H200 machine's 128 GiB holds 25 of Llama-8B's
    # 32 layer inputs at 500K tokens), so the split between device and host is the plan's to choose, as Megatron-Core's
    # `cpu_offloading_num_layers`; TRL's all-or-nothing `activation_offloading` stays as it is.
    liger_head: str = field(
        default="auto",
        metadata={"help": "With `use_liger_kernel` / `use_liger_loss`, the head that computes the loss: 'auto' (the "
                  "faster of Liger's fused linear cross-entropy and leantune's chunked head, timed once on the GPU "
                  "when the trainer is built, and logged), 'liger' or 'chunked'."},
    )
    tiled_attention_projections: bool = field(
        default=False,
        metadata={"help": "With `tiled_mlp`, also run each decoder layer's norms and attention projections (q, k, v, o "
                  "with their LoRA adapters) over tiles of the sequence, at the tiled MLP's tile, in the forward and "
                  "the recompute: their fp32 upcasts and dropout masks exist for one tile at a time; the attention "
                  "itself runs on the whole sequence (exact)."},
    )
    # Why beside `tiled_mlp` and not alone: one tile size (`tiled_mlp_tile_size`) serves both, so the plan sizes one
    # tile; the MLP's [tokens, intermediate] is the larger of the two, so tiling the projections alone saves the
    # smaller part only.


def validate_memory_options(args) -> None:
    if args.loss_chunk_size is not None and args.loss_chunk_size <= 0:
        raise ValueError(f"`loss_chunk_size` must be a positive integer or None, got {args.loss_chunk_size!r}.")
    if args.memory_budget is not None and str(args.memory_budget).strip().lower() != "auto":
        parse_budget(args.memory_budget)  # a size or a GPU name, else a ValueError naming `memory_budget`
    elif args.memory_budget is not None:
        if args.use_cpu or not torch.cuda.is_available():  # planning/self_sizing.py reads CUDA's free memory
            raise ValueError("`memory_budget`=auto reads a CUDA device's free memory, and this run has no CUDA "
                             "device; give the memory to fit as a size, e.g. 2GiB or 1500MiB.")
    if args.tiled_mlp_tile_size is not None and (not args.tiled_mlp or args.tiled_mlp_tile_size <= 0):
        raise ValueError(f"`tiled_mlp_tile_size` needs `tiled_mlp=True` and a positive number of tokens, got "
                         f"tiled_mlp={args.tiled_mlp}, tiled_mlp_tile_size={args.tiled_mlp_tile_size!r}.")
    if args.tiled_attention_projections and not args.tiled_mlp:
        raise ValueError("`tiled_attention_projections=True` tiles the norms and attention projections at the tiled "
                         "MLP's tile (`tiled_mlp_tile_size`); set `tiled_mlp=True` too, or leave it False.")
    if args.activation_offloading_min_bytes < 0:
        raise ValueError("`activation_offloading_min_bytes` must be >= 0.")
    # TRL spells the Liger request use_liger_kernel (SFT; a TrainingArguments field) or use_liger_loss.
    for flag in ("use_liger_kernel", "use_liger_loss"):
        if getattr(args, flag, False) and not args.chunked_loss:
            raise ValueError(f"`{flag}=True` never computes the full logits that `chunked_loss=False` asks for (Liger "
                             f"on CUDA, else the chunked loss); set `chunked_loss=True` or `{flag}=False`.")
    fused = getattr(args, "use_liger_kernel", False) or getattr(args, "use_liger_loss", False)
    if args.liger_head not in HEAD_CHOICES:
        raise ValueError(f"`liger_head` must be one of {', '.join(HEAD_CHOICES)}, got {args.liger_head!r}.")
    if args.liger_head != "auto" and not fused:
        raise ValueError(f"`liger_head={args.liger_head!r}` chooses the head under Liger and has no effect without "
                         "`use_liger_kernel=True` or `use_liger_loss=True`; set one or leave `liger_head` unset.")
    if args.loss_chunk_size is not None and not args.chunked_loss and not fused:
        raise ValueError("`loss_chunk_size` has no effect with `chunked_loss=False` (the model computes the full "
                         "logits); set `chunked_loss=True` or leave `loss_chunk_size` unset.")
    if not args.activation_offloading:
        for name in non_default(args, "activation_offloading_use_streams", "activation_offloading_min_bytes"):
            raise ValueError(f"`{name}` has no effect without `activation_offloading=True`; set "
                             f"`activation_offloading=True` or leave `{name}` at its default.")
    if args.optimizer_in_backward:
        validate_optimizer_in_backward(args)
    validate_checkpoint_offload(args)


def validate_checkpoint_offload(args) -> None:
    """`checkpoint_offload_layers` read once, here: an int >= 0 (a digit string from the command line becomes one),
    'auto' or None; refused where it cannot work."""
    value = args.checkpoint_offload_layers
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = args.checkpoint_offload_layers = int(value)
    elif isinstance(value, str):  # "None" is how a command line (or a printed recommendation) spells off
        value = args.checkpoint_offload_layers = None if value.strip().lower() == "none" else value.strip().lower()
    if value is None or value == 0:
        return
    if not (value == "auto" or (isinstance(value, int) and not isinstance(value, bool))):
        raise ValueError(f"`checkpoint_offload_layers` must be a number of decoder layers (-k: all but the last k), "
                         f"'auto' or None, got {args.checkpoint_offload_layers!r}.")
    problem = unsupported_by_transformers()
    if problem:
        raise ValueError(problem)
    if not checkpointing_setting(args)[0]:
        raise ValueError("`checkpoint_offload_layers` offloads the layer inputs that gradient checkpointing keeps; "
                         "with `gradient_checkpointing=False` there are none: turn checkpointing on or leave it unset.")
    if args.activation_offloading:
        raise ValueError("`checkpoint_offload_layers` with `activation_offloading=True`: activation offloading already "
                         "moves every saved activation, these inputs included; set one of them off.")
    if args.deepspeed or args.fsdp:
        raise ValueError("`checkpoint_offload_layers` does not work with `deepspeed` or `fsdp` (their engines "
                         "checkpoint and offload by their own settings); set one of them off.")


def validate_optimizer_in_backward(args) -> None:
    """What the optimizer step inside the backward cannot do, refused before anything loads
    (trainers/parts/optimizer_in_backward.py says why each)."""
    if args.max_grad_norm:  # None or 0: no clipping
        raise ValueError(f"`optimizer_in_backward=True` steps each parameter before the whole gradient's norm is known, "
                         f"so it cannot clip it; set `max_grad_norm=0` (off) or `optimizer_in_backward=False` (got "
                         f"`max_grad_norm={args.max_grad_norm}`).")
    engines = {"deepspeed": args.deepspeed, "fsdp": args.fsdp}
    for name, engine in engines.items():
        if engine:
            raise ValueError(f"`optimizer_in_backward=True` does not work with `{name}` (its engine owns the "
                             f"gradients and the optimizer step); set one of them off.")
    if args.fp16:
        raise ValueError("`optimizer_in_backward=True` does not work with `fp16=True` (the loss scaler unscales and "
                         "checks every gradient before the step); use `bf16=True` or fp32.")
    if args.nonfinite_policy == "skip":
        raise ValueError("`optimizer_in_backward=True` does not work with `nonfinite_policy='skip'` (each parameter "
                         "is updated before the step's gradient norm is known); use `nonfinite_policy='stop'`.")
    optim = str(getattr(args.optim, "value", args.optim))
    if any(kind in optim for kind in OPTIMIZERS_OF_THEIR_OWN):
        raise ValueError(f"`optimizer_in_backward=True` builds one optimizer per parameter, which `optim={optim!r}` "
                         f"cannot be (it steps the model or its groups itself); use an AdamW/SGD/Adafactor/bitsandbytes "
                         f"optim or `optimizer_in_backward=False`.")


OPTIMIZERS_OF_THEIR_OWN = ("lomo", "galore", "apollo", "schedule_free", "grokadamw")
"""`optim` kinds that step over the model or their own parameter groups, never one parameter at a time."""
