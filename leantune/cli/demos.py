"""What the built-in demos of the training commands share (`leantune sft | dpo | kto | reward | grpo | rloo` with no
model and no dataset): settings the user did not set, the demo's character tokenizer and a small model, the SFT
warm-up, and the offline demos' train -> evaluate -> save -> summary."""

from __future__ import annotations

import os
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from ..defaults import build_default_model_config, build_default_tokenizer, evaluate_exact_match
from ..trainers.sft_config import SFTConfig
from ..trainers.sft_trainer import SFTTrainer
from .arguments import peft_config_from


def apply_demo_settings(args, explicit: set[str], defaults: dict) -> None:
    """Demo defaults for every field not set by a flag or the YAML file; single-threaded torch on a small CPU run."""
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # spin-waiting OpenMP threads on shared cores slow a tiny model down
    settings = {"save_strategy": "no", "logging_first_step": True, **defaults}
    for name, value in settings.items():
        if name not in explicit:
            setattr(args, name, value)
    args.__post_init__()
    torch.manual_seed(args.seed)


def demo_model(model_args):
    """The SFT demo's character tokenizer and a small Llama from its config, random weights."""
    tokenizer = build_default_tokenizer()
    model = AutoModelForCausalLM.from_config(build_default_model_config(tokenizer))
    return tokenizer, model, peft_config_from(model_args)


def train_and_save(trainer, print_summary, evaluate=None):
    """Train, then `evaluate(trainer)` if given, save the model and print the command's summary (whose time spans
    all three). Returns what `evaluate` returned: the demo's "after" (its "before" is the demo's own)."""
    started = time.perf_counter()
    result = trainer.train()
    after = evaluate(trainer) if evaluate is not None else None
    trainer.save_model(trainer.args.output_dir)
    print_summary(trainer, result, time.perf_counter() - started)
    return after


def sft_warm_up(model, tokenizer, pairs, seed: int, steps: int = 150):
    """A short SFT run on the chosen completions: preference training usually starts from an SFT model, and a
    random model has no sense of the task for a preference signal to refine."""
    examples = pairs.rename_column("chosen", "completion").remove_columns("rejected")
    return supervised_warm_up(model, tokenizer, examples, seed, max_steps=steps)


def supervised_warm_up(model, tokenizer, examples, seed: int, max_steps: int = 150, held_out=None,
                       target_exact_match: float | None = None, check_every: int = 10):
    """SFT on prompt-completion examples for `max_steps`, or until greedy exact match on `held_out` first reaches
    `target_exact_match` (checked every `check_every` steps): the online demo starts from a model that is right
    part of the time, so its rewards have room to rise."""
    class StopAtExactMatch(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % check_every == 0:
                exact_match = evaluate_exact_match(model, tokenizer, held_out)["exact_match"]
                control.should_training_stop = exact_match >= target_exact_match

    watch = StopAtExactMatch() if target_exact_match is not None else None
    with tempfile.TemporaryDirectory(prefix="leantune-warm-up-") as output_dir:
        args = SFTConfig(output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=32,
                         learning_rate=1e-3, lr_scheduler_type="constant", max_length=64, report_to=[],
                         save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=seed,
                         memory_breakdown=False, use_cpu=not __import__("torch").cuda.is_available())
        trainer = SFTTrainer(model=model, args=args, train_dataset=examples, processing_class=tokenizer,
                             callbacks=[watch] if watch else None)
        trainer.train()
    return trainer.model
