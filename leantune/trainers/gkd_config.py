"""GKDConfig: TRL's GKD fields (trl.experimental.gkd) on top of leantune's SFTConfig."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config_utils import positive_or_none
from .sft_config import SFTConfig


@dataclass
class GKDConfig(SFTConfig):
    """Configuration of Generalized Knowledge Distillation (arXiv 2306.13649). Defaults match TRL's."""

    temperature: float = field(default=0.9, metadata={
        "help": "Sampling temperature of the on-policy (and seq_kd) completions. The divergence itself is taken at "
                "temperature 1, as in TRL."})
    lmbda: float = field(default=0.5, metadata={
        "help": "Share of optimizer steps trained on the student's own completions (on-policy), decided per step "
                "from the seed; the others train on the dataset's completions."})
    beta: float = field(default=0.5, metadata={
        "help": "Generalised JSD interpolation in [0, 1]: 0 = KL(teacher || student) (forward KL), 1 = KL(student "
                "|| teacher) (reverse KL)."})
    max_new_tokens: int = field(default=128, metadata={"help": "Most tokens generated per completion."})
    teacher_model_name_or_path: str | None = field(default=None, metadata={
        "help": "Id or path of the teacher (used when the trainer is given no `teacher_model`)."})
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "from_pretrained keyword arguments for a teacher given by id or path (dtype, quantization_config for "
                "a 4/8-bit teacher, ...)."})
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in the student."})
    seq_kd: bool = field(default=False, metadata={
        "help": "Sequence-level KD: on the steps that are not on-policy, the teacher generates the completions "
                "trained on."})

    def __post_init__(self):
        super().__post_init__()
        for name in ("lmbda", "beta"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"`{name}` must be in [0, 1], got {value!r}.")
        if not self.temperature > 0.0:
            raise ValueError(f"`temperature` must be > 0 (it divides the logits when sampling), got "
                             f"{self.temperature!r}.")
        positive_or_none(self.max_new_tokens, "max_new_tokens")
        if self.max_new_tokens is None:
            raise ValueError("`max_new_tokens` must be a positive integer, got None.")
