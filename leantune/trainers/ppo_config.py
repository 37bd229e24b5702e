"""PPOConfig: the names and meanings of TRL's last PPOConfig (trl 0.2x; TRL 1.x removed PPO), on the online
fields of online_config.py (generation backends, vLLM and sleep mode, ZeRO-3 gathering, the memory engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..losses.ppo import KL_ESTIMATORS
from .online_config import OnlineConfig

# OnlineConfig fields whose role PPO's own fields take: set, they are refused with the field to use instead.
PPO_REPLACED_FIELDS = {"beta": "kl_coef", "epsilon": "cliprange", "epsilon_high": "cliprange",
                       "num_iterations": "num_ppo_epochs", "steps_per_generation": "num_mini_batches",
                       "generation_batch_size": "num_mini_batches"}


@dataclass
class PPOConfig(OnlineConfig):
    """Proximal Policy Optimization with a learned value function (RLHF form). Defaults match TRL's last PPO.

    A generation round holds `num_mini_batches` optimizer steps of completions (per_device_train_batch_size x
    processes x gradient_accumulation_steps each); it is trained `num_ppo_epochs` times.
    """

    min_num_generations = 1  # the value function is the baseline: no groups needed
    implemented_trl_fields = ("reward_model_path",)  # TRL's PPO scores with it (Online DPO's refuses it)

    learning_rate: float = field(default=5e-5, metadata={"help": "Initial AdamW learning rate."})
    num_generations: int = field(default=1, metadata={"help": "Completions sampled per prompt."})
    max_completion_length: int = field(default=53, metadata={"help": "Most tokens of a completion (TRL: "
                                                                    "response_length)."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature (also applied when scoring)."})

    num_ppo_epochs: int = field(default=4, metadata={"help": "Optimisation passes over each generation round."})
    num_mini_batches: int = field(default=1, metadata={"help": "Optimizer steps per pass over a generation round."})
    whiten_rewards: bool = field(default=False, metadata={
        "help": "Whiten the per-token rewards (scale only, mean kept) over the round's tokens on all processes."})
    kl_coef: float = field(default=0.05, metadata={
        "help": "KL coefficient: -kl_coef x the per-token KL to the reference is each token's reward; 0 loads no "
                "reference."})
    kl_estimator: str = field(default="k1", metadata={
        "help": "Per-token KL estimator: k1 (log pi - log ref) or k3 (exp(ref - pi) - (ref - pi) - 1, never "
                "negative, lower variance)."})
    cliprange: float = field(default=0.2, metadata={"help": "Clip range of the probability ratio."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value around its rollout value."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "Lambda of generalised advantage estimation."})
    missing_eos_penalty: float | None = field(default=None, metadata={
        "help": "Subtracted from the score of a completion that ends without EOS (positive)."})
    response_length: int | None = field(default=None, metadata={
        "help": "TRL's name of max_completion_length (set one of them)."})
    reward_model_path: str | None = field(default=None, metadata={
        "help": "Reward model (Hub id or folder) used when the trainer is given no reward_model (TRL: a default "
                "Hub model; leantune loads nothing unasked)."})

    def __post_init__(self):
        for name, replacement in PPO_REPLACED_FIELDS.items():
            value, default = getattr(self, name), self.__dataclass_fields__[name].default
            if name == "num_iterations" and (value == self.num_ppo_epochs or getattr(self, "_resolved", False)):
                continue  # set from num_ppo_epochs by an earlier __post_init__ (a copy, or a demo's new settings)
            if value != default:
                raise ValueError(f"`{name}` is not a PPO field: PPO uses `{replacement}`; leave `{name}` at its "
                                 f"default.")
        if self.response_length is not None:
            if self.max_completion_length not in (53, self.response_length):
                raise ValueError(f"`response_length` ({self.response_length}) and `max_completion_length` "
                                 f"({self.max_completion_length}) are one setting: set one of them.")
            self.max_completion_length = self.response_length
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"`kl_estimator` must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}.")
        for name in ("num_ppo_epochs", "num_mini_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be at least 1, got {getattr(self, name)}.")
        for name in ("kl_coef", "cliprange", "vf_coef", "cliprange_value"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}.")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"`{name}` must be in [0, 1], got {getattr(self, name)}.")
        if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
            raise ValueError(f"`missing_eos_penalty` must be positive (it is subtracted), got "
                             f"{self.missing_eos_penalty}.")
        self.num_iterations = self.num_ppo_epochs
        self._resolved = True
        super().__post_init__()

    def generation_plan(self, world_size: int) -> tuple[int, int]:
        """A round is `num_mini_batches` optimizer steps of completions."""
        steps = self.gradient_accumulation_steps * self.num_mini_batches
        return self.per_device_train_batch_size * world_size * steps, steps
