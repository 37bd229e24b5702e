"""GRPO's entropy bonus (TRL 1.16's meaning): loss - coef x H, H the mean entropy of the micro-batch's loss tokens,
divided only by the gradient-accumulation steps, never by a loss type's own normaliser (so `entropy_coef` means the
same for every loss type).

With `use_adaptive_entropy` the coefficient follows a target: after each optimizer step the entropy of the whole
step (every micro-batch, every process) moves it up by `entropy_coef_delta` when at or below `entropy_target`, down
otherwise, within [entropy_coef_min, entropy_coef_max]; the bonus applies only while the last step's entropy was at
or below the target (none before the first measurement). Coefficient and gate stay fixed within a step.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

STATE_FILE = "entropy_ctrl_state.json"  # TRL's name, so a checkpoint resumes in either library


@dataclass
class EntropyBonus:
    coef: float
    adaptive: bool = False
    target: float = 0.0
    coef_min: float = 0.0
    coef_max: float = 1.0
    delta: float = 0.005
    last_step_entropy: float = math.inf
    _window: list[float] = field(default_factory=lambda: [0.0, 0.0])  # entropy sum, token count of this step

    @classmethod
    def from_config(cls, args) -> EntropyBonus | None:
        if args.entropy_coef == 0.0 and not args.use_adaptive_entropy:
            return None
        return cls(args.entropy_coef, args.use_adaptive_entropy, args.entropy_target, args.entropy_coef_min,
                   args.entropy_coef_max, args.entropy_coef_delta)

    @property
    def applied_coef(self) -> float:
        if self.adaptive and self.last_step_entropy > self.target:
            return 0.0
        return self.coef

    def term(self, entropy: torch.Tensor, accumulation_steps: int) -> torch.Tensor:
        """The value added to the micro-batch's loss: -coef x mean(entropy) / accumulation steps."""
        mean = entropy.sum() / max(int(entropy.numel()), 1)
        return -self.applied_coef * mean / accumulation_steps

    def added(self, loss: torch.Tensor, entropy: torch.Tensor, accumulation_steps: int, training: bool,
              step_ends: bool, reduce_sum) -> tuple[torch.Tensor, dict]:
        """(the micro-batch's normalised loss plus the bonus, its metrics). While training, the adaptive coefficient
        observes the entropies and moves when the optimizer step ends (`step_ends`; `reduce_sum`: see end_step)."""
        metrics = {"policy_loss": loss.detach() * accumulation_steps}  # the policy term at the logged loss's scale
        loss = loss + self.term(entropy, accumulation_steps)
        if training:
            if self.adaptive:
                self.observe(entropy)
            if step_ends:
                if self.adaptive:
                    self.end_step(reduce_sum)
                metrics["entropy_coef"] = torch.tensor(self.coef, device=loss.device)
        return loss, metrics

    def observe(self, entropy: torch.Tensor) -> None:
        self._window[0] += float(entropy.detach().sum())
        self._window[1] += int(entropy.numel())

    def end_step(self, reduce_sum) -> None:
        """At an optimizer step's end: the step's entropy over all processes (`reduce_sum` of a tensor) moves the
        coefficient for the next step."""
        totals = reduce_sum(torch.tensor(self._window, dtype=torch.float64))
        self._window = [0.0, 0.0]
        entropy = float(totals[0] / max(float(totals[1]), 1.0))
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_step_entropy = entropy

    def save(self, folder: str) -> None:
        with open(os.path.join(folder, STATE_FILE), "w") as handle:
            json.dump({"entropy_coef": self.coef, "last_world_entropy": self.last_step_entropy}, handle)

    def load(self, folder: str) -> None:
        """The coefficient where the checkpoint's run left it; a checkpoint without it (written without
        use_adaptive_entropy, or by an older leantune) is an error, not a silent restart from `entropy_coef`."""
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            raise ValueError(f"`use_adaptive_entropy`: the checkpoint {folder} holds no {STATE_FILE} (the adaptive "
                             "entropy coefficient); it was written by a run without `use_adaptive_entropy`, so "
                             "resuming would restart the coefficient. Resume with the run's own settings, or start "
                             "a new run.")
        with open(path) as handle:
            state = json.load(handle)
        self.coef, self.last_step_entropy = float(state["entropy_coef"]), float(state["last_world_entropy"])
