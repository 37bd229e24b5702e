"""RLOOConfig: TRL's field names and meanings (online fields in online_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .online_config import OnlineConfig


@dataclass
class RLOOConfig(OnlineConfig):
    """REINFORCE Leave-One-Out. Defaults match TRL's."""

    num_generations: int = field(default=2, metadata={"help": "Completions sampled per prompt (a group)."})
    beta: float = field(
        default=0.05,
        metadata={"help": "KL coefficient: beta x the completion's summed log-ratio to the reference is taken off its "
                  "reward; 0 loads no reference model."},
    )
    normalize_advantages: bool = field(default=False, metadata={"help": "Normalise advantages over the batch."})
    reward_clip_range: tuple[float, float] | None = field(
        default=None, metadata={"help": "Clip rewards to this (low, high) range before the baseline."}
    )

    def __post_init__(self):
        if self.reward_clip_range is not None:
            low, high = (float(v) for v in self.reward_clip_range)
            if low > high:
                raise ValueError(f"`reward_clip_range` must be (low, high), got {self.reward_clip_range}.")
            self.reward_clip_range = (low, high)
        super().__post_init__()
