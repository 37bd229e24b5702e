"""Policy and reference models for the trainers that compare against a frozen reference (DPO, KTO).

The reference costs no second copy when it can be avoided: with a PEFT adapter it is the policy with the adapter
disabled; with `precompute_ref_log_probs` its log-probs are computed once before training; otherwise it is a frozen
copy (the given `ref_model`, or a deep copy of the initial policy) in eval mode.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch

from ..models.loading import apply_peft, ensure_pad_token, load_causal_lm, load_tokenizer
from ..models.output_head import unwrap_model
from ..models.segment_attention import SEGMENT_SDPA, use_segment_attention

logger = logging.getLogger("leantune.trainer")

# The collated entries a causal LM's forward takes (padded or segmented layouts).
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                "max_length_k")


@dataclass
class PolicyAndReference:
    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    tokenizer: object
    uses_adapter_as_reference: bool

    def description(self, args) -> str:
        if self.uses_adapter_as_reference:
            return "the policy with its adapter disabled (no second copy)"
        if args.precompute_ref_log_probs and self.ref_model is None:
            return "log-probs of the initial policy, computed once before training (no reference held in training)"
        if args.precompute_ref_log_probs:
            return "log-probs of the given ref_model, computed once before training"
        return "a separate frozen model in eval mode"


def load_policy_and_reference(model, ref_model, processing_class, peft_config, args) -> PolicyAndReference:
    """Load the policy (and tokenizer), apply PEFT, and choose the reference by the rules above."""
    model_source = model
    model = load_causal_lm(model, args.model_init_kwargs)
    tokenizer = load_tokenizer(model_source, processing_class)
    ensure_pad_token(tokenizer, None)
    model.config.use_cache = False
    if args.padding_free and use_segment_attention(model):
        logger.info("Padding-free batches: attention runs per sequence (%s).", SEGMENT_SDPA)
    model = apply_peft(model, peft_config, args)
    adapter_reference = ref_model is None and hasattr(model, "disable_adapter")
    if ref_model is not None:
        ref_model = load_causal_lm(ref_model, args.ref_model_init_kwargs)
        if args.padding_free:
            use_segment_attention(ref_model)
    elif not adapter_reference and not args.precompute_ref_log_probs:
        ref_model = copy.deepcopy(unwrap_model(model))  # a separate, frozen copy of the initial policy
    if ref_model is not None:
        ref_model.requires_grad_(False).eval()
    if args.disable_dropout:
        for module in (model, ref_model):
            if module is not None:
                disable_dropout(module)
    return PolicyAndReference(model, ref_model, tokenizer, adapter_reference)


def unwrap_adapter_owner(model):
    """The PEFT model (under accelerate/DDP wrappers) whose `disable_adapter()` gives the reference."""
    while not hasattr(model, "disable_adapter") and hasattr(model, "module"):
        model = model.module
    return model


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
