"""Tiny model config and training recipe for the no-argument ``leantune sft`` run.

Why these numbers: the run must finish end to end in under 3 minutes on 2 CPU
cores, in fp32, with gradient checkpointing on, while other processes may be
competing for the same cores.  A 2-layer, 128-wide Llama (~0.54 M parameters)
learns the default ``reverse`` task (see :mod:`leantune.defaults.tasks`) from
0% to ~100% held-out exact match in roughly 200-300 optimizer steps at batch
size 32; the recipe below gives it 400 steps so the result does not hinge on
when the "reversal" circuit happens to click in (0.95-1.0 over six seeds).
Measured cost: ~55-90 ms per step on an idle 2-core machine, ~145 ms per step
with four other busy processes *if* torch runs one intra-op thread (or
OMP_WAIT_POLICY=PASSIVE); with two spin-waiting OpenMP threads on a contended
machine the same 400 steps took 5-10 minutes.
"""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig

# Recommended values for the built-in run.  ``num_train``/``num_eval`` (RUN_ONLY_KEYS)
# are dataset sizes for build_default_dataset; every other key is a TRL-style
# SFTConfig / transformers 5 TrainingArguments field.  lr 1e-3 was reliable
# across seeds; 2e-3 and above made the reversal circuit form late or not at all.
DEFAULT_TRAINING: dict[str, Any] = {
    "num_train": 12_800,  # 1 epoch at batch 32 -> 400 optimizer steps
    "num_eval": 200,
    "learning_rate": 1e-3,
    "per_device_train_batch_size": 32,
    "gradient_accumulation_steps": 1,
    "num_train_epochs": 1,
    "max_steps": -1,
    "warmup_steps": 20,  # 5% of the 400 steps (transformers 5 also accepts a float ratio here)
    "lr_scheduler_type": "cosine",
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "max_length": 64,
    "completion_only_loss": True,
    "gradient_checkpointing": True,
    "gradient_checkpointing_kwargs": {"use_reentrant": False},
    "logging_steps": 25,
}
RUN_ONLY_KEYS = frozenset({"num_train", "num_eval"})


def build_default_model_config(tokenizer, max_position_embeddings: int = 64) -> LlamaConfig:
    """A ~0.54 M-parameter Llama sized for the bundled character-level tokenizer.

    Input and output embeddings are tied: with a ~100-token vocabulary this
    saves little memory but regularises the tiny model and changes nothing else.
    """
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
