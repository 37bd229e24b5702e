"""What a method's trainer says about itself, with the defaults of a method that says nothing more: its models, its
recipe for a split, its collator, what its loss is averaged over, its own checkpoint state, how its metrics are
logged. `LeantuneTrainer` (base.py) runs these in one construction sequence and one step; a method file overrides
only the ones that are its own."""

from __future__ import annotations

import torch

from .. import methods
from ..losses.token_logprobs import count_targets
from ..metrics.run_metrics import mean_of_values


class MethodHooks:
    # Dataset columns the collators read; everything else is removed by Trainer.
    dataset_columns: tuple[str, ...] = ()
    # Columns whose presence marks a dataset as already prepared by this trainer's recipe (see `is_prepared`).
    prepared_columns: tuple[str, ...] = ()
    # The trainer's entry in leantune/methods.py (config, TRL's names and defaults, the command line, the planner).
    method: str = ""
    # Whether `trainer.eval_dataset` stays the object the user passed (TRL's online trainers), its prepared form
    # kept aside for evaluate(), rather than being replaced by the prepared dataset.
    keeps_eval_dataset_as_given = False
    # Whether the trainer's log-probs are of logits divided by `args.temperature` (the online trainers').
    scores_at_temperature = False
    # Whether the trained model scores a vocabulary (a reward model scores sequences: nothing to chunk or fuse).
    scores_vocabulary = True
    stream_order = None  # (stream, split, args) -> (stream, config of its buffers): how a stream is read (SFT's)

    # --- construction ------------------------------------------------------------------------------------------

    def default_args(self, model, args):
        """TRL's default config: the method's config class with output_dir "<model name>-<method>"."""
        if args is not None:
            return args
        name, method = model if isinstance(model, str) else type(model).__name__, methods.of(self)
        return method.config_class(output_dir=f"{str(name).split('/')[-1]}-{method.output_suffix}")

    def load_models(self, model, ref_model, processing_class, peft_config, args, quantization_config):
        """The trained model (PEFT applied), its tokenizer and the frozen models: a PolicyAndReference."""
        raise NotImplementedError

    def make_collator(self, tokenizer, args, train_dataset):
        raise NotImplementedError

    def frozen_model_sources(self) -> dict:
        """The frozen models as given, before they load (reward functions, a teacher): what `memory_budget` plans."""
        return {}

    def context_parallel_problem(self, args) -> str | None:
        """An option of the method's that context parallelism cannot run exactly, said as "<option> (why)"."""
        return None

    def liger_notes(self, args) -> list[tuple[int, str]]:
        """(log level, text) of what the method's loss takes from Liger and what it does not, said once at start."""
        return []

    def frozen_models(self) -> list[torch.nn.Module]:
        """Models held and run without training (reference, reward models, teacher): their own part of the memory."""
        return self.reference.frozen()

    # --- data: the method's recipe, run by the split preparer ----------------------------------------------------

    def prepare_split(self, dataset, split: str, tokenizer, args):
        """(prepared dataset, report or None) of one map-style split, by the trainer's recipe. Called before Trainer's
        own set-up (so it uses the `tokenizer` and `args` it is given, not `self.processing_class` / `self.args`)."""
        raise NotImplementedError

    def skips_preparation(self, args) -> bool:
        """Whether the data is given trainer-ready (SFT's `dataset_kwargs={"skip_prepare_dataset": True}`)."""
        return False

    def is_prepared(self, dataset) -> bool:
        return self.splits.is_prepared(dataset)

    # --- the step, the checkpoint, the logs ----------------------------------------------------------------------

    def items_in(self, batch: dict) -> torch.Tensor:
        """What the loss is averaged over, in one collated batch: target tokens (pairs for preference losses)."""
        return count_targets(batch["labels"])

    def trained_batches(self, batches: list) -> list:
        """A step's micro-batches as they are trained on and counted (GKD regenerates their completions)."""
        return batches

    def write_model_files(self, save_pretrained, folder: str, state_dict, **kwargs) -> None:
        """The model's files in a saved folder: `save_pretrained` (the model's own) of `state_dict` (a sharding
        engine's gathered weights, else None); PPO writes its value function beside the policy."""
        save_pretrained(folder, state_dict=state_dict, **kwargs)

    def save_extra_state(self, folder: str) -> None:
        """The trainer's own state beyond transformers' (GRPO's adaptive entropy coefficient, ...), written into the
        staged checkpoint folder before it is renamed: a checkpoint holds it or does not exist."""

    def load_extra_state(self, folder: str) -> None:
        """What `save_extra_state` wrote, read back when training resumes from the checkpoint `folder` (at the start
        of training, after transformers loaded the model, optimizer and scheduler)."""

    def summarise_metrics(self, store: dict[str, list[float]]) -> dict[str, float]:
        """The logged form of the method's stored values: their means (NaN left out); a method may say more."""
        return mean_of_values(store)
