"""Evaluation of an online method, as TRL's: completions for the held-out prompts are generated and rewarded (the
round's metrics, under `eval_`), and the method's loss on them is reported as `<prefix>_loss` (on-policy: ratios
of 1, the method's inputs from the eval groups)."""

from __future__ import annotations

import torch

from ..parts.batches import placed
from .round_builder import row_batches


def evaluate_rounds(trainer, dataset, metric_key_prefix: str) -> dict:
    """One prepared eval split (the base `evaluate` prepares raw ones and runs each of a dict)."""
    args, accelerator, store = trainer.args, trainer.accelerator, trainer.run_metrics.values["eval"]
    group = args.eval_num_generations
    size = max(1, args.per_device_eval_batch_size // group) * accelerator.num_processes
    store.clear()
    model = trainer.model_wrapped
    was_training = model.training
    model.eval()
    try:
        for prompt_rows in row_batches(dataset, size):
            prompt_rows = prompt_rows[: len(prompt_rows) - len(prompt_rows) % accelerator.num_processes]
            if prompt_rows:
                record_eval_loss(trainer, model, trainer.rounds.eval_round(prompt_rows, group))
    finally:
        model.train(was_training)
    metrics = {f"{metric_key_prefix}_{name}": value for name, value in trainer.summarise_metrics(store).items()}
    store.clear()
    trainer.log(dict(metrics))
    trainer.control = trainer.callback_handler.on_evaluate(args, trainer.state, trainer.control, metrics)
    return metrics


@torch.no_grad()
def record_eval_loss(trainer, model, batches: list[dict]) -> None:
    for batch in batches:
        loss = trainer.compute_loss(model, placed(trainer, batch))
        trainer.run_metrics.values["eval"]["loss"].append(trainer.accelerator.gather(loss.detach().reshape(1)).mean().item())
