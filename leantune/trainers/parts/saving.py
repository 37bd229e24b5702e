"""Saving: a checkpoint exists whole or not at all, and every saved folder says what it holds (its model card).

transformers' checkpoint is written into `tmp-checkpoint-N/checkpoint-N` with the trainer's own state, fsynced and
renamed to `checkpoint-N` only when whole (checkpoint_files.py); the rotation of --save_total_limit and a push to the
Hub come after the rename. A write that fails for want of space removes the staging folder and raises NoRoomError,
the last complete checkpoint untouched, on every process at once (the processes agree on each part's outcome).
At resume the processes agree on the checkpoint: process 0's choice, which every process must be able to read.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil

import torch
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ... import methods
from ...models import model_card
from ...models.output_head import text_config_of, unwrap_model
from ...utils.faults import TrainingFault
from . import checkpoint_files, model_files
from .distributed import gather_from_all, is_collective_timeout

logger = logging.getLogger("leantune.trainer")

# Config fields that hold a credential: blanked in every training_args.bin leantune leaves (checkpoints, the final
# model), which push_to_hub uploads; the run itself keeps them
SECRET_FIELDS = ("hub_token",)


def without_secrets(args):
    """A copy of the config with its credentials blanked (None), for a file that outlives the run."""
    safe = copy.copy(args)
    for name in SECRET_FIELDS:
        if getattr(safe, name, None) is not None:
            setattr(safe, name, None)
    return safe


def save_arguments(args, folder: str) -> None:
    """The run's config, as Trainer saves it beside a model, without its credentials (SECRET_FIELDS)."""
    torch.save(without_secrets(args), os.path.join(folder, TRAINING_ARGS_NAME))


def save_final_model(trainer, output_dir: str | None, internal_call: bool, save_model) -> None:
    """Trainer's `save_model` (`save_model`: transformers' own) of the final model into `output_dir`, staged and
    moved in as model_files.py says: a kill at any moment leaves the old final model or the new one loading from
    output_dir, whole; checkpoint-N and the logs beside it untouched. The saved config has no credentials. A
    checkpoint's model is written directly (its whole folder is being staged, checkpoint_files.py). The push that
    transformers' `save_model` makes when the user calls it comes after the model is in place."""
    target = output_dir if output_dir is not None else trainer.args.output_dir
    args, trainer.args = trainer.args, without_secrets(trainer.args)  # Trainer saves its args beside the model
    try:
        with model_files_saved(trainer):  # the model's files by `write_model_files`, and its card
            if checkpoint_files.STAGING.match(os.path.basename(os.path.dirname(os.path.abspath(target)))):
                save_model(target, internal_call)
                return
            _staged_model_save(trainer, os.fspath(target), save_model)
    finally:
        trainer.args = args
    if args.push_to_hub and not internal_call:
        trainer.push_to_hub(commit_message="Model save", revision=args.hub_revision)


def _staged_model_save(trainer, target: str, save_model) -> None:
    staged = model_files.staged_folder(target)
    writer = trainer.args.should_save
    if writer:
        checkpoint_files.remove_tree(staged)  # a final save that a kill cut short
        os.makedirs(staged)
        readme = os.path.join(target, "README.md")
        if os.path.isfile(readme) and not model_card.may_write(target):  # the user's own card is kept
            shutil.copy2(readme, staged)
    try:
        save_model(staged, True)
        if writer:
            model_files.publish_model(staged, target)
    except Exception as error:
        if not writer:
            raise
        written = checkpoint_files.folder_bytes(staged)
        checkpoint_files.remove_tree(staged)  # the old final model, if any, is as it was
        if checkpoint_files.is_no_room(error, target):
            raise checkpoint_files.no_room_error(target, written, "the final model") from error
        raise


class CheckpointSaveFault(TrainingFault):
    """Another process's part of a checkpoint save failed: this one stops with it (its error is in that log)."""


@contextlib.contextmanager
def model_files_saved(trainer):
    """During Trainer's `save_model`: the model's own `save_pretrained` writes through the trainer's
    `write_model_files` (a gathered FSDP2 / ZeRO-3 state dict without its tied head copy; PPO's value function beside
    the policy), then the model card on the writing process. A README.md that is not leantune's (checked before PEFT
    writes its own template) is left as it is. A save inside a save (push_to_hub's) writes through the outer one."""
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    if "save_pretrained" in vars(model):
        yield
        return
    save_pretrained = model.save_pretrained

    def save_files(folder, state_dict=None, **kwargs):
        card = trainer.args.should_save and model_card.may_write(folder)
        if state_dict is not None:
            state_dict = without_tied_copies(model, state_dict)
        trainer.write_model_files(save_pretrained, folder, state_dict, **kwargs)
        if card:
            try:
                model_card.write_model_card(trainer, folder)
            except Exception as error:  # the weights are saved; a card that cannot be written must not end the run
                logger.warning("Could not write the model card README.md in %s: %s", folder, error)
        elif trainer.args.should_save:
            logger.info("%s already has a README.md not written by leantune: left as it is.", folder)

    model.save_pretrained = save_files
    try:
        with writing_on_each_node(trainer):
            yield
    finally:
        del model.save_pretrained


@contextlib.contextmanager
def writing_on_each_node(trainer):
    """transformers' `save_pretrained` writes on global process 0 alone whatever `is_main_process` says (5.x:
    `should_save_on_this_rank`), so with save_on_each_node the other nodes' checkpoints held no weights or config
    and could not be resumed there: during the save, each node's writing process (`should_save`) writes them."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if not (trainer.args.save_on_each_node and trainer.args.should_save and trainer.args.world_size > 1
            and hasattr(model, "should_save_on_this_rank")):
        yield
        return
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        yield
    finally:
        del model.should_save_on_this_rank


class StagedCheckpoint:
    """One checkpoint save: transformers writes into the staging folder, which Trainer's `_save_checkpoint` takes for
    the run's folder while the trainer's `args` are a copy naming it (the one write to the trainer, undone at the end;
    leantune's trainers take no `model_init`, so no hyperparameter-search trial has a folder of its own): rotation
    there finds one checkpoint and removes nothing, and the copy pushes nothing. The push to the Hub
    (`_push_from_checkpoint`, docs/transformers_seam.md) is of the renamed folder, after the rename.

    Each of the save's three parts (the staging folder, every process's files, the rename) ends with the processes
    agreeing on its outcome (`_together`) where a barrier stood: a part that failed on one process (a full disk on
    the writing one) stops every process at once with the same error, instead of leaving the others waiting at the
    next barrier until `ddp_timeout`."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.run_dir = trainer.args.output_dir
        self.step = trainer.state.global_step
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.step}"
        self.staging_root = checkpoint_files.staging_folder(self.run_dir, self.step)
        self.staged, self.final = os.path.join(self.staging_root, name), os.path.join(self.run_dir, name)

    def save(self, model, trial, save_checkpoint) -> None:
        trainer, args = self.trainer, self.trainer.args
        self._together(self._open_staging)
        self._warn_if_not_shared()
        trainer.args = without_secrets(args)  # a copy: Trainer's save reads the run's folder and the push from it
        trainer.args.output_dir, trainer.args.push_to_hub = self.staging_root, False
        try:
            self._together(lambda: save_checkpoint(model, trial))  # every process's files (rng_state_<i>.pth) are in
        finally:
            trainer.args = args
        self._together(self._publish)
        if args.push_to_hub:
            trainer._push_from_checkpoint(self.final)
        if args.should_save:
            rotate_checkpoints(output_dir=self.run_dir, save_total_limit=args.save_total_limit,
                               best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)

    def _open_staging(self) -> None:
        if self.trainer.args.should_save:
            checkpoint_files.remove_tree(self.staging_root)  # a save of this step that a kill cut short
            os.makedirs(self.staged)

    def _warn_if_not_shared(self) -> None:
        """A process that does not see the writing process's staging folder is on a node without a shared file
        system (and without save_on_each_node): said at the first save, not when a resume there fails."""
        trainer = self.trainer
        if trainer.args.should_save or trainer.args.world_size == 1 or os.path.isdir(self.staged):
            return
        if not getattr(trainer, "_said_not_shared", False):
            trainer._said_not_shared = True
            logger.warning("Process %d does not see %s, which the process writing checkpoints created: its node does "
                           "not share output_dir's file system, so a resume there cannot read the checkpoints; put "
                           "output_dir on a shared file system or train with save_on_each_node=True.",
                           trainer.args.process_index, self.staged)

    def _publish(self) -> None:
        if self.trainer.args.should_save:
            arguments = os.path.join(self.staged, TRAINING_ARGS_NAME)
            if os.path.exists(arguments):  # the run's own arguments, as Trainer saves them (not the staging copy)
                save_arguments(self.trainer.args, self.staged)
            self._point_best_checkpoint_at()
            self.trainer.save_extra_state(self.staged)
            checkpoint_files.publish(self.staged, self.final)
            checkpoint_files.remove_tree(self.staging_root)

    def _together(self, part) -> None:
        """Run this process's `part`, then learn every process's outcome; if any failed, the staging folder goes
        and every process raises: the no-room line of the first process that ran out of space, else its own error
        (a process that did not fail: CheckpointSaveFault naming the one that did)."""
        error = outcome = None
        try:
            part()
        except Exception as caught:
            if is_collective_timeout(caught):  # a process is stuck or gone: no agreement to wait for
                raise
            error, outcome = caught, self._outcome(caught)
        outcomes = gather_from_all(outcome)
        if all(found is None for found in outcomes):
            return
        if self.trainer.args.should_save:
            checkpoint_files.remove_tree(self.staging_root)
        no_room = next((found["text"] for found in outcomes if found is not None and found["no_room"]), None)
        if no_room is not None:
            raise checkpoint_files.NoRoomError(no_room) from error
        if error is not None:
            raise error
        rank, failed = next((rank, found) for rank, found in enumerate(outcomes) if found is not None)
        raise CheckpointSaveFault(f"process {rank} could not write checkpoint-{self.step} ({failed['text']}); the "
                                  "last complete checkpoint is intact: see that process's log.")

    def _outcome(self, error: Exception) -> dict:
        """What the other processes learn of this one's failed part: whether it ran out of space (with the line
        saying where, how much and what to do) or its error in one line."""
        if not checkpoint_files.is_no_room(error, self.run_dir):
            return {"no_room": False, "text": " ".join(f"{type(error).__name__}: {error}".split())[:300]}
        written = checkpoint_files.folder_bytes(self.staging_root)
        if self.trainer.args.should_save:  # gone before the free space is measured
            checkpoint_files.remove_tree(self.staging_root)
        earlier = [checkpoint_files.folder_bytes(os.path.join(self.run_dir, entry))
                   for entry in os.listdir(self.run_dir) if entry.startswith(f"{PREFIX_CHECKPOINT_DIR}-")]
        text = str(checkpoint_files.no_room_error(self.run_dir, max([written, *earlier]), f"checkpoint-{self.step}"))
        return {"no_room": True, "text": text}

    def _point_best_checkpoint_at(self) -> None:
        """transformers looked for the best checkpoint beside the staged one: the state names its final folder."""
        state = self.trainer.state
        best = state.best_global_step
        if not best:
            return
        path = os.path.join(self.run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
        if best == state.global_step or os.path.isdir(path):
            state.best_model_checkpoint = path
            state.save_to_json(os.path.join(self.staged, "trainer_state.json"))


def resume_checkpoint(given, output_dir: str):
    """train()'s `resume_from_checkpoint`: True means the newest complete checkpoint (incomplete entries named)."""
    if given is not True:
        return given
    found = checkpoint_files.latest_complete_checkpoint(output_dir)
    if found is None:
        raise ValueError(f"`resume_from_checkpoint`=True: no complete checkpoint (checkpoint-N with a "
                         f"trainer_state.json) in {output_dir}.")
    return found


def agreed_resume_checkpoint(given, args):
    """The checkpoint every process resumes from (one process: its own choice)."""
    if args.world_size == 1:
        return resume_checkpoint(given, args.output_dir)
    return process_zeros_checkpoint(given, args)


def process_zeros_checkpoint(given, args):
    """Process 0's choice of checkpoint, for every process (processes resolve `True` each in its own view of
    output_dir, and one that found another checkpoint, or none, would train from another state). Only process 0
    writes checkpoints unless `save_on_each_node`, so on nodes without a shared file system the others cannot read
    it: then every process stops with one line, instead of one failing and the rest waiting for it."""
    try:
        chosen, problem = resume_checkpoint(given, args.output_dir), None
    except ValueError as error:  # process 0's problem is every process's; another's choice is replaced
        chosen, problem = None, str(error)
    chosen, problem = gather_from_all((chosen, problem))[0]
    if problem:
        raise ValueError(problem)
    readable = chosen is None or checkpoint_files.readable_state(os.fspath(chosen))
    unreadable = [str(rank) for rank, ok in enumerate(gather_from_all(readable)) if not ok]
    if unreadable:
        raise ValueError(
            f"resume_from_checkpoint: process 0 resumes from {os.fspath(chosen)}, which process(es) "
            f"{', '.join(unreadable)} cannot read (no readable trainer_state.json there): only process 0 writes "
            "checkpoints unless save_on_each_node; put output_dir on a file system every node shares, or train with "
            "save_on_each_node=True (--save_on_each_node true) so that each node writes its own copy.")
    return chosen


def tag_model(trainer) -> None:
    """The Hub tags TRL's trainers put on the model (`trl`, the method) and leantune's own, so a pushed model is
    found by the same filters as one trained with TRL."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(model, "add_model_tags"):
        method = methods.of(trainer)
        model.add_model_tags(list(dict.fromkeys(["leantune", "trl", method.card_name, method.trl_tag])))


def write_hub_card(trainer, tags=None, **kwargs) -> None:
    """push_to_hub's card: leantune's (what the folder holds and how to load it), with the caller's tags and
    language / license / datasets metadata, in place of transformers' generic one."""
    if trainer.is_world_process_zero():
        dataset = kwargs.get("dataset_tags") or kwargs.get("dataset")
        metadata = {"language": kwargs.get("language"), "license": kwargs.get("license"), "datasets": dataset}
        model_card.write_model_card(trainer, trainer.args.output_dir, extra_tags=tags, metadata=metadata)


def without_tied_copies(model, state_dict: dict) -> dict:
    """A gathered full state dict (FSDP2, ZeRO-3) holds a tied output head as its own tensor, which transformers
    would write as a second vocabulary-sized matrix: the tied key is dropped when it equals the input embedding."""
    base = unwrap_model(model)
    config = text_config_of(base)
    if not getattr(config, "tie_word_embeddings", False):
        return state_dict
    embeddings, head = base.get_input_embeddings(), base.get_output_embeddings()
    if embeddings is None or head is None:
        return state_dict
    names = {id(module): name for name, module in model.named_modules()}
    embedding_key, head_key = f"{names.get(id(embeddings))}.weight", f"{names.get(id(head))}.weight"
    if (embedding_key in state_dict and head_key in state_dict and head_key != embedding_key
            and torch.equal(state_dict[embedding_key], state_dict[head_key])):
        state_dict = {k: v for k, v in state_dict.items() if k != head_key}
    return state_dict
