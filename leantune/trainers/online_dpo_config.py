"""OnlineDPOConfig: TRL's field names and meanings (trl.experimental.online_dpo); the generation, backend and memory
fields are the online trainers' (online_config.py).

Online DPO samples two completions per prompt, so `num_generations` is fixed at 2, and `per_device_train_batch_size`
counts prompts (pairs), as in TRL: a micro-batch scores twice that many completions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config_utils import non_default
from .online_config import OnlineConfig

ONLINE_DPO_LOSS_TYPES = ("sigmoid", "ipo")
# Online fields with no meaning in Online DPO (TRL's OnlineDPOConfig has none of them): refused when set.
NOT_IN_ONLINE_DPO = {
    "epsilon": "the DPO loss has no probability ratio to clip",
    "epsilon_high": "the DPO loss has no probability ratio to clip",
    "num_iterations": "each pair is trained on once, as in TRL",
    "generation_batch_size": "a round is `per_device_train_batch_size` prompts x processes x `steps_per_generation`",
    "mask_truncated_completions": "use `missing_eos_penalty` to prefer completions that end",
}


@dataclass
class OnlineDPOConfig(OnlineConfig):
    """Online Direct Preference Optimization. Defaults match TRL's."""

    learning_rate: float = field(default=5e-7, metadata={"help": "Initial AdamW learning rate."})
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in the policy and reference."})
    reward_model_path: str | None = field(
        default=None, metadata={"help": "TRL's unused field; pass reward models in `reward_funcs`. Not supported."}
    )
    max_new_tokens: int = field(default=64, metadata={"help": "Most tokens of a sampled completion."})
    max_completion_length: int | None = field(
        default=None, metadata={"help": "GRPO's name of max_new_tokens (the same value; set one of them)."}
    )
    max_length: int = field(
        default=512,
        metadata={"help": "Most tokens of prompt + completion when scoring: the prompt's start is cut (counted)."},
    )
    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature (scoring is at temperature 1)."})
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Subtracted from the reward of a completion that ends without EOS, before the pair's "
                  "choice (a positive value)."},
    )
    beta: list[float] = field(
        default_factory=lambda: [0.1],
        metadata={"help": "Strength of the pull towards the reference (IPO's tau); a list gives one per epoch, the "
                  "last for the remaining epochs."},
    )
    loss_type: str = field(default="sigmoid", metadata={"help": "sigmoid (DPO) or ipo."})
    num_generations: int = field(default=2, metadata={"help": "Completions per prompt: Online DPO compares 2."})
    vllm_gpu_memory_utilization: float = field(
        default=0.55, metadata={"help": "Colocate: share of GPU memory the engine may take."}
    )

    def __post_init__(self):
        if isinstance(self.beta, (int, float)):
            self.beta = [float(self.beta)]
        self.beta = [float(beta) for beta in self.beta]
        if len(self.beta) == 1:  # TRL keeps one value as a float
            self.beta = self.beta[0]
        self._resolve_completion_length()
        super().__post_init__()
        validate_online_dpo_config(self)

    def _resolve_completion_length(self) -> None:
        """max_completion_length (the online trainers' name) follows max_new_tokens (TRL's name for Online DPO)."""
        length = self.max_completion_length
        if length == getattr(self, "_mirrored_length", None):  # a copy made by an earlier __post_init__
            length = None
        if length is not None and length != self.max_new_tokens:
            if self.max_new_tokens != 64:
                raise ValueError(f"`max_new_tokens` ({self.max_new_tokens}) and `max_completion_length` ({length}) "
                                 "name the same limit: set one of them.")
            self.max_new_tokens = length
        self.max_completion_length = self._mirrored_length = self.max_new_tokens

    @property
    def betas(self) -> list[float]:
        return self.beta if isinstance(self.beta, list) else [self.beta]

    def beta_at(self, epoch: float) -> float:
        """The beta of this epoch (0-based; the last value for epochs past the list)."""
        betas = self.betas
        return betas[min(int(epoch), len(betas) - 1)]

    def generation_plan(self, world_size: int) -> tuple[int, int]:
        """Completions per round: two for each of the round's prompts (`per_device_train_batch_size` counts prompts)."""
        prompts, steps = super().generation_plan(world_size)
        return 2 * prompts, steps


def validate_online_dpo_config(args: OnlineDPOConfig) -> None:
    if args.num_generations != 2:
        raise ValueError(f"`num_generations` must be 2 in Online DPO (a pair of completions per prompt), got "
                         f"{args.num_generations}.")
    if args.num_generations_eval not in (None, 2):
        raise ValueError(f"`num_generations_eval` must be 2 (or unset) in Online DPO, got {args.num_generations_eval}.")
    for name in non_default(args, *NOT_IN_ONLINE_DPO):
        raise ValueError(f"`{name}` does not apply to Online DPO: {NOT_IN_ONLINE_DPO[name]}; leave it at its default.")
    if args.loss_type not in ONLINE_DPO_LOSS_TYPES:
        raise ValueError(f"`loss_type` must be one of {ONLINE_DPO_LOSS_TYPES} in Online DPO, got {args.loss_type!r}.")
    if not args.betas or any(beta <= 0 for beta in args.betas):
        raise ValueError(f"`beta` must be positive (one value, or one per epoch), got {args.beta}: Online DPO's loss "
                         "divides by it (ipo) or is flat without it (sigmoid).")
    if args.missing_eos_penalty is not None and args.missing_eos_penalty < 0:
        raise ValueError(f"`missing_eos_penalty` must be positive, got {args.missing_eos_penalty}.")
    if args.max_new_tokens >= args.max_length:
        raise ValueError(f"`max_new_tokens` ({args.max_new_tokens}) must be below `max_length` ({args.max_length}): "
                         "scoring keeps at most max_length tokens, so a prompt needs room; raise `max_length`.")
