"""TRL config fields shared by several of leantune's configs, declared once (like MemoryOptions).

Each mixin comes before TrainingArguments in a config's bases. Fields leantune does not implement yet are listed in
config_utils.UNSUPPORTED_TRL_FIELDS: they exist with TRL's defaults, so a TRL script constructs its config unchanged,
and a value other than the default is refused when the config is built."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelLoadingOptions:
    """Every trainer."""

    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Run the Python code a model folder or Hub repo ships with (custom architectures) when the "
                  "model, reference, reward models and tokenizer are loaded by name. A `trust_remote_code` in "
                  "model_init_kwargs takes precedence."},
    )


@dataclass
class CausalLMOptions(ModelLoadingOptions):
    """Every trainer of a causal language model (all but the reward trainer)."""

    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={"help": "Weight of a Mixture-of-Experts model's load-balancing loss, added when the model's config "
                  "has output_router_logits=True (None: the config's router_aux_loss_coef)."},
    )


@dataclass
class ReferenceSyncOptions:
    """Trainers with a reference model (DPO, KTO, GRPO, RLOO): TR-DPO's periodic reference update."""

    sync_ref_model: bool = field(
        default=False,
        metadata={"help": "Every `ref_model_sync_steps` steps, move the reference towards the policy (TR-DPO); needs "
                  "a separate reference model (not a PEFT adapter's base, not precomputed log-probs)."},
    )
    ref_model_mixup_alpha: float = field(
        default=0.6,
        metadata={"help": "TR-DPO: share of the policy in the updated reference (alpha x policy + (1 - alpha) x "
                  "reference). Only with `sync_ref_model`."},
    )
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "TR-DPO: optimizer steps between reference updates. Only with `sync_ref_model`."}
    )
