"""The teacher of distillation (GKD): a frozen model the student learns from, loaded once beside the student and
placed for the sharding engine like every frozen model (trainers/parts/frozen_models.py)."""

from __future__ import annotations

import torch

from ...models.loading import load_causal_lm
from ...models.output_head import OutputHead, ShardedOutputHead, text_config_of
from ...models.segment_attention import use_segment_attention
from .frozen_models import prepare_frozen_model


class Teacher:
    """The frozen teacher: `model` (placed once the accelerator exists), its output head and its forward passes,
    without gradient."""

    def __init__(self, source, student, init_kwargs: dict | None, trust_remote_code: bool, segmented_rows: bool):
        """`init_kwargs`: from_pretrained's for a teacher given by id or path; `segmented_rows`: the trainer's rows
        hold several sequences (packing, padding-free), which the teacher attends to one by one as the student."""
        self.model = load_causal_lm(source, init_kwargs, trust_remote_code=trust_remote_code)
        self.model.requires_grad_(False).eval()
        check_same_vocabulary(student, self.model)
        if segmented_rows:
            use_segment_attention(self.model)

    def place(self, accelerator, args) -> None:
        self.model = prepare_frozen_model(accelerator, self.model, args)

    @property
    def head(self) -> OutputHead:
        """Its head as placed for any engine (ZeRO-3 partitions a frozen teacher too), its weights read at each call."""
        return ShardedOutputHead.of(self.model)

    @torch.no_grad()
    def logits(self, inputs: dict) -> torch.Tensor:
        return self.model(**inputs, use_cache=False).logits

    @torch.no_grad()
    def hidden_states(self, inputs: dict, head: OutputHead) -> torch.Tensor:
        """The last hidden states, for a loss that runs the teacher's head itself (chunk by chunk, or Liger)."""
        with head.capture_hidden_states() as captured:
            self.model(**inputs, use_cache=False)
        return captured["hidden"]


def check_same_vocabulary(student, teacher) -> None:
    """Distillation compares whole next-token distributions: the two output heads must score the same vocabulary."""
    sizes = [(getattr(text_config_of(m), "vocab_size", None), OutputHead.of(m).vocab_size) for m in (student, teacher)]
    if sizes[0][1] != sizes[1][1]:
        raise ValueError(f"The student's output head scores {sizes[0][1]} tokens (vocab_size {sizes[0][0]}) but the "
                         f"teacher's scores {sizes[1][1]} (vocab_size {sizes[1][0]}): GKD compares the two models' "
                         "whole next-token distributions, so they need the same vocabulary (tokenizer).")
