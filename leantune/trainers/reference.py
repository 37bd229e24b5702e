"""Policy and reference models for the trainers that compare against a reference (DPO, KTO, GRPO, RLOO, Online DPO,
PPO): loaded by leantune's rules, then held by the trainer as its `Reference` part (placed, precomputed, synced).

The reference costs no second copy when it can be avoided: with a PEFT adapter it is the policy with the adapter
disabled; with `precompute_ref_log_probs` its log-probs are computed once before training; otherwise it is a frozen
copy (the given `ref_model`, or a deep copy of the initial policy) in eval mode, which `sync_ref_model` (TR-DPO) moves
towards the policy every `ref_model_sync_steps` steps.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass, replace

import torch
from transformers import TrainerCallback

from .. import methods
from ..data.streaming import is_stream
from ..models.loading import apply_peft, ensure_pad_token, load_causal_lm, load_tokenizer, with_quantization_config
from ..models.output_head import unwrap_model
from ..models.segment_attention import SEGMENT_SDPA, use_segment_attention
from .online.shared_prompt import shared_prompt_for
from .parts.batches import placed
from .parts.frozen_models import zero3_enabled
from .settings import checkpointing_of, reference_of

logger = logging.getLogger("leantune.trainer")


@dataclass
class PolicyAndReference:
    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    tokenizer: object
    uses_adapter_as_reference: bool
    precomputes: bool = False  # `precompute_ref_log_probs`: its log-probs are computed once before training
    shared_prompt: bool = False  # the policy scores shared-prompt rows (as the layout asked and the model allows)

    def description(self) -> str:
        precompute = self.precomputes
        if self.ref_model is None and not self.uses_adapter_as_reference and not precompute:
            return "none (the objective does not use one)"
        if self.uses_adapter_as_reference:
            return "the policy with its adapter disabled (no second copy)"
        if precompute and self.ref_model is None:
            return "log-probs of the initial policy, computed once before training (no reference held in training)"
        if precompute:
            return "log-probs of the given ref_model, computed once before training"
        return "a separate frozen model in eval mode"


def load_policy_and_reference(model, ref_model, processing_class, peft_config, args,
                              needs_reference: bool = True, quantization_config=None, *,
                              padding_free: bool, shared_prompt: bool = False,
                              precompute: bool = False) -> PolicyAndReference:
    """Load the policy (and tokenizer), apply PEFT, and choose the reference by the rules above (none at all when
    the objective does not use one, e.g. GRPO with beta=0). `padding_free`, `shared_prompt`: the trainer's layout (the
    model's check may turn a default-on shared prompt off: `PolicyAndReference.shared_prompt`); `precompute`: the
    reference's log-probs are computed once before training (ReferenceSettings)."""
    if ref_model is not None and ref_model is model and not isinstance(model, str):
        raise ValueError("`ref_model` is the policy `model` itself, so the reference would train with it: pass a "
                         "separate copy (or a model id / path), or leave ref_model=None for a frozen copy of the "
                         "initial policy.")
    model_source = model
    model = load_causal_lm(model, with_quantization_config(model, args.model_init_kwargs, quantization_config),
                           trust_remote_code=args.trust_remote_code)
    tokenizer = load_tokenizer(model_source, processing_class, trust_remote_code=args.trust_remote_code)
    ensure_pad_token(tokenizer, getattr(args, "pad_token", None))  # DPOConfig has TRL's pad_token
    model.config.use_cache = False
    if (padding_free or shared_prompt) and use_segment_attention(model):  # online: prompt-sharing rows need it too
        logger.info("Padding-free batches: attention runs per sequence (%s).", SEGMENT_SDPA)
    shared_prompt = shared_prompt_for(model, args, shared_prompt)  # refused, or (the default) off for a model that cannot
    model = apply_peft(model, peft_config, checkpointing_of(args).enabled)
    adapter_reference = needs_reference and ref_model is None and hasattr(model, "disable_adapter")
    if not needs_reference:
        ref_model = None
    elif ref_model is not None:
        ref_model = load_causal_lm(ref_model, getattr(args, "ref_model_init_kwargs", None),
                                   trust_remote_code=args.trust_remote_code)
    elif not adapter_reference and not precompute:
        ref_model = initial_policy_copy(model, model_source, args)
    if ref_model is not None:
        # a given reference, or the policy's copy loaded again under ZeRO-3, reads the same rows as the policy
        if padding_free or shared_prompt:
            use_segment_attention(ref_model)
        if shared_prompt:
            shared_prompt_for(ref_model, args, shared_prompt)
        ref_model.requires_grad_(False).eval()
    if args.disable_dropout:
        for module in (model, ref_model):
            if module is not None:
                disable_dropout(module)
    return PolicyAndReference(model, ref_model, tokenizer, adapter_reference, precompute, shared_prompt)


def initial_policy_copy(model, model_source, args):
    """A separate, frozen copy of the initial policy. Under ZeRO-3 the policy was partitioned as it loaded (each
    process holds a slice), so the copy is loaded again from the same source, partitioned the same way."""
    if not zero3_enabled():
        return copy.deepcopy(unwrap_model(model))
    if isinstance(model_source, str):
        return load_causal_lm(model_source, args.model_init_kwargs, trust_remote_code=args.trust_remote_code)
    raise ValueError("Under DeepSpeed ZeRO-3 a reference cannot be copied from a model object (its weights are "
                     "partitioned over the processes): pass the model as an id or path, or pass `ref_model`.")


def unwrap_adapter_owner(model):
    """The PEFT model (under accelerate/DDP wrappers) whose `disable_adapter()` gives the reference."""
    while not hasattr(model, "disable_adapter") and hasattr(model, "module"):
        model = model.module
    return model


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


class Reference:
    """The reference a loss compares the policy against, as one part every trainer holds (SFT's, the reward model's
    and GKD's hold none): a frozen model (placed for the engine once the accelerator exists), the policy with its
    adapter disabled, or nothing held once its log-probs are precomputed. The trainer's train() and evaluate() have
    it precompute those log-probs first (the trainer names its reference columns and fills them:
    `reference_columns`, `reference_values`) and train() installs TR-DPO's sync.
    `ready`: the reference values are computable now (False until precomputed log-probs are in)."""

    def __init__(self, loaded: PolicyAndReference, settings, placed_model: torch.nn.Module | None):
        """Made once Trainer's set-up made the accelerator: `placed_model` is the separate reference placed for the
        engine (frozen_models.prepare_frozen_model); `settings`: ReferenceSettings (trainers/settings.py)."""
        self.settings = settings
        self.model = placed_model
        self.uses_adapter = loaded.uses_adapter_as_reference
        self.precomputes = settings.precompute
        self.ready = not self.precomputes
        self.dropped = False  # a separate reference let go once its log-probs were computed
        self.sync = None  # TR-DPO's ReferenceSync, once installed
        self.works_before_training = settings.precompute or settings.sync  # else train() has nothing for it to do

    def frozen(self) -> list[torch.nn.Module]:
        """A separate reference is held frozen (a disabled adapter or precomputed log-probs hold none)."""
        return [self.model] if self.model is not None else []

    def drop(self) -> None:
        """No reference is held during training once its log-probs are computed."""
        if self.model is not None:
            self.model = None
            self.dropped = True
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    @contextlib.contextmanager
    def scope(self, policy, policy_if_none: bool = False):
        """The frozen reference, or the policy with its adapter off; the initial policy itself when precomputing."""
        if self.model is not None:
            yield self.model
        elif self.uses_adapter:
            with unwrap_adapter_owner(policy).disable_adapter():
                yield policy
        elif policy_if_none:
            yield policy
        else:
            raise RuntimeError("Reference log-probs were neither precomputed nor computable (no reference model).")

    # --- before training: precomputed log-probs, TR-DPO's sync ---------------------------------------------------

    def before_training(self, trainer) -> None:
        self.precompute(trainer)
        if self.settings.sync and self.sync is None:
            self.install_sync(trainer)

    def precompute(self, trainer) -> None:
        """The reference log-probs of the train and eval datasets, once (then a separate reference is dropped)."""
        if self.ready:
            return
        if self.model is None and zero3_enabled():
            raise ValueError("`precompute_ref_log_probs=True` under DeepSpeed ZeRO-3 needs a separate `ref_model`: the "
                             "policy's weights stay partitioned until training starts, so it cannot score the data "
                             "before; pass `ref_model` (it gets an inference engine of its own), or use ZeRO-2 or FSDP.")
        trainer.train_dataset = self.with_logps(trainer, trainer.train_dataset, "train")
        if isinstance(trainer.eval_dataset, dict):
            trainer.eval_dataset = {name: self.with_logps(trainer, data, f"eval_{name}")
                                    for name, data in trainer.eval_dataset.items()}
        elif trainer.eval_dataset is not None:
            trainer.eval_dataset = self.with_logps(trainer, trainer.eval_dataset, "eval")
        self.ready = True
        self.drop()

    def install_sync(self, trainer) -> None:
        if self.model is None:
            raise ValueError("`sync_ref_model=True` needs a separate reference model to move; with a PEFT adapter the "
                             "reference is the base model with the adapter off, which has nothing to sync. Train "
                             "without PEFT, or set `sync_ref_model=False`.")
        if trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
            raise ValueError("`sync_ref_model=True` under DeepSpeed ZeRO-3 is not supported yet (the sharded weights "
                             "would have to be gathered to mix them); use ZeRO-2, FSDP or DDP.")
        self.sync = ReferenceSync(trainer, self.settings.sync_steps, self.settings.mixup_alpha)
        trainer.add_callback(self.sync)

    def finish_eval_split(self, trainer, dataset, split: str):
        """A dataset first seen by `evaluate`: with `precompute_ref_log_probs`, its reference log-probs are computed
        now, while the reference is still at hand (adapter disabled, or the untrained policy before any step)."""
        if not self.precomputes:
            return dataset

        if is_stream(dataset):
            raise ValueError("`precompute_ref_log_probs` is not supported with IterableDataset (a stream): the "
                             "reference log-probs are computed in one pass over a whole dataset; pass a "
                             "datasets.Dataset, or turn `precompute_ref_log_probs` off.")
        if all(name in dataset.column_names for name in trainer.reference_columns(dataset)):
            return dataset
        if self.model is None and not self.uses_adapter and (self.dropped or trainer.state.global_step > 0):
            raise ValueError("Cannot compute reference log-probs for a dataset passed to evaluate() after training "
                             "started with `precompute_ref_log_probs` and no reference kept in memory: pass it as "
                             "eval_dataset to the trainer instead.")
        return self.with_logps(trainer, dataset, split)

    @torch.no_grad()
    def with_logps(self, trainer, dataset, split: str):
        """One pass over the dataset (in order) with the reference; adds the trainer's reference columns."""
        names = trainer.reference_columns(dataset)
        if all(name in dataset.column_names for name in names):
            return dataset
        size = self.settings.precompute_batch_size or self.settings.batch_size
        columns = {name: [] for name in names}
        with self.scope(trainer.model, policy_if_none=True) as model:
            was_training = model.training
            model.eval()
            try:
                for start in range(0, len(dataset), size):
                    rows = [dataset[i] for i in range(start, min(start + size, len(dataset)))]
                    batch = placed(trainer, trainer.data_collator(rows))
                    for name, values in trainer.reference_values(model, batch, len(rows)).items():
                        columns[name].extend(values.float().cpu().tolist())
            finally:
                model.train(was_training)
        logger.info("Precomputed reference log-probs (%s) of %d %s rows.", ", ".join(names), len(dataset), split)
        for name, values in columns.items():
            dataset = dataset.remove_columns(name) if name in dataset.column_names else dataset
            dataset = dataset.add_column(name, values)
        return dataset


class ReferenceModelMixin:
    """What a method with a reference (DPO, KTO; the online trainers) says of its own: whether it wants one, how it
    is announced, the columns its precomputed log-probs fill; and TRL's attributes. The `reference` part does the
    rest (loading rules above, placing, precomputing, TR-DPO's sync)."""

    def reference_wanted(self, args) -> bool:
        """False: no reference at all (e.g. GRPO with beta = 0)."""
        return True

    def load_models(self, model, ref_model, processing_class, peft_config, args, quantization_config):
        """The policy (PEFT applied), its tokenizer and the reference by leantune's rules (load_policy_and_reference),
        announced in one line."""
        loaded = load_policy_and_reference(model, ref_model, processing_class, peft_config, args,
                                           needs_reference=self.reference_wanted(args),
                                           quantization_config=quantization_config,
                                           padding_free=self.layout.padding_free,
                                           shared_prompt=self.layout.shared_prompt,
                                           precompute=reference_of(args).precompute)
        # the layout as the loaded model allows (a default-on shared prompt is off for a model that cannot)
        self.layout = replace(self.layout, shared_prompt=loaded.shared_prompt)
        logger.info("%s", self.reference_note(loaded, args))
        return loaded

    def reference_note(self, loaded, args) -> str:
        return f"{methods.of(self).output_suffix} reference: {loaded.description()}."

    def reference_columns(self, dataset) -> tuple[str, ...]:
        """The columns of precomputed reference values (precompute_ref_log_probs)."""
        raise NotImplementedError

    def reference_values(self, model, batch: dict, rows: int) -> dict[str, torch.Tensor]:
        """Per-row reference values of one collated batch, by column name."""
        raise NotImplementedError

    # TRL's attribute (read-only), and whether the reference is the disabled adapter
    ref_model = property(lambda self: self.reference.model)
    uses_adapter_as_reference = property(lambda self: self.reference.uses_adapter)


class ReferenceSync(TrainerCallback):
    """TR-DPO's reference update (TRL's `sync_ref_model`): every `ref_model_sync_steps` optimizer steps,
    ref <- (1 - alpha) ref + alpha policy, parameter by parameter, alpha = `ref_model_mixup_alpha`."""

    def __init__(self, trainer, every: int, alpha: float):
        self.trainer, self.every, self.alpha = trainer, every, alpha

    @torch.no_grad()
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every:
            return
        unwrap = self.trainer.accelerator.unwrap_model
        mix_into(unwrap(self.trainer.reference.model), unwrap(self.trainer.model), self.alpha)


@torch.no_grad()
def mix_into(target: torch.nn.Module, source: torch.nn.Module, alpha: float) -> None:
    """target <- (1 - alpha) target + alpha source, matching parameters by name."""
    sources = dict(source.named_parameters())
    for name, parameter in target.named_parameters():
        parameter.mul_(1.0 - alpha).add_(sources[name].to(parameter.dtype), alpha=alpha)
