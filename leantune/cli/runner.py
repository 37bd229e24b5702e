"""One run of every training command (`leantune sft | dpo | kto | reward | grpo | ...`, one per entry of
leantune/methods.py): parse, check the cheap things, load the data and check its columns, then load the model, train
(or resume), save, summarise.

A method's `cli` module holds only what differs: the built-in demo and the summary lines of its method (the demos'
shared pieces are in demos.py, the summary's frame is print_run_summary here).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time

from datasets import Dataset, IterableDataset

from .. import methods
from ..data.formats import detect_sft_format
from ..data.kto_preparation import detect_kto_format
from ..data.loading import load_dataset_source, rename_columns
from ..data.preference_formats import detect_preference_format
from ..generation.backend import check_backend_requirements
from ..methods import BY_COMMAND, KTO_DATA, PREFERENCE_DATA, PROMPT_DATA, SFT_DATA, Method
from ..rewards import resolve_reward_funcs
from ..trainers.parts.checkpoint_files import NoRoomError, is_no_room, no_room_error
from ..trainers.settings import generation_engine
from .arguments import argument_types, model_init_kwargs_from, peft_config_from
from .errors import UsageError, one_line
from .optional_packages import check_optional_packages
from .parser import parse_command_args
from .preflight import check_model_source, check_output_dir, clear_checkpoints, resolve_resume

logger = logging.getLogger("leantune.cli")


def run_method(command: str, argv: list[str]) -> int:
    """`leantune <command> ...` for the method whose command it is."""
    method = BY_COMMAND[command]
    parsed = parse_command_args(f"leantune {command}", argument_types(method), argv)
    script_args, model_args, args, explicit = parsed[0], parsed[-3], parsed[-2], parsed[-1]
    reward_args = parsed[1] if method.online else None
    module = importlib.import_module(method.cli)
    if (model_args.model_name_or_path is None) != (script_args.dataset_name is None):
        missing = "--model_name_or_path" if model_args.model_name_or_path is None else "--dataset_name"
        raise UsageError(f"{missing} is required (give both --model_name_or_path and --dataset_name, or neither "
                         "for the built-in demo).")
    check_optional_packages(args, model_args)  # a missing tracker or kernel package: one line, before any load
    if method.online:  # a generation backend that cannot run here fails now, not after a demo's warm-up
        check_backend_requirements(generation_engine(args), bool(args.vllm_enable_sleep_mode))
    if model_args.model_name_or_path is None:
        if args.resume_from_checkpoint:
            raise UsageError("--resume_from_checkpoint: the built-in demo saves no checkpoints to resume from; "
                             "give --model_name_or_path and --dataset_name.")
        if "output_dir" not in explicit:
            args.output_dir = method.demo_output_dir
        if method.online:
            return module.run_demo(method, args, model_args, reward_args, explicit)
        return module.run_demo(args, model_args, explicit)
    return train_on_data(method, module, script_args, model_args, args, reward_args)


def train_on_data(method: Method, module, script_args, model_args, args, reward_args=None) -> int:
    # 1. what costs nothing to check: the output folder, the checkpoint, the model's source, the reward names
    check_output_dir(args.output_dir)
    resume = resolve_resume(args.resume_from_checkpoint, args.output_dir, script_args.overwrite_output_dir)
    check_model_source(model_args.model_name_or_path)
    extra = {}
    if method.online and not (getattr(args, "reward_model_path", None) and not reward_args.reward_funcs):
        extra["reward_funcs"] = online_reward_funcs(reward_args)  # PPO: --reward_model_path stands for them
    # 2. the data, and whether its columns fit the method, before the model is loaded
    train, evaluation = load_splits(script_args, args)
    for split, dataset in (("train", train), ("eval", evaluation)):
        if dataset is not None:
            check_columns(method.data, dataset, args, split)
    # 3. the run; --overwrite_output_dir deletes the earlier run's checkpoints only once the model and data loaded
    if args.model_init_kwargs is None:
        args.model_init_kwargs = model_init_kwargs_from(model_args)
    trainer = method.trainer_class(model=model_args.model_name_or_path, args=args, train_dataset=train,
                                    eval_dataset=evaluation, peft_config=peft_config_from(model_args), **extra)
    if resume is None and script_args.overwrite_output_dir and trainer.is_world_process_zero():
        clear_checkpoints(args.output_dir)
    trainer.accelerator.wait_for_everyone()
    started = time.perf_counter()
    with no_room_as_usage_error():
        result = trainer.train(resume_from_checkpoint=resume)
    with no_room_as_usage_error(args.output_dir, trainer):
        trainer.save_model(args.output_dir)
    if trainer.is_world_process_zero():
        if resume:
            print(f"resumed from {resume}")
        if trainer.trained_nothing:
            print(f"nothing to train: {resume} is at step {trainer.state.global_step} of max_steps "
                  f"{trainer.state.max_steps} (raise --max_steps or --num_train_epochs to train further)")
        module.print_summary(trainer, result, time.perf_counter() - started)
    trainer.accelerator.end_training()  # processes leave the group together, not torn down one by one at exit
    return 0


@contextlib.contextmanager
def no_room_as_usage_error(folder: str | None = None, trainer=None):
    """A write that fails for want of disk space ends the run in one line (where, how much, what to do), exit 2."""
    try:
        yield
    except NoRoomError as error:
        raise UsageError(str(error)) from error
    except Exception as error:
        if folder is None or not is_no_room(error, folder):
            raise
        needed = sum(p.numel() * p.element_size() for p in trainer.model.parameters()) if trainer else 0
        raise UsageError(str(no_room_error(folder, needed, "the model"))) from error


def print_run_summary(trainer, result, seconds: float, lines: list[str]) -> None:
    """The summary every training command ends with: its steps and time, the method's own `lines`, peak memory and
    where the model went."""
    metrics = result.metrics
    print("\n".join(["", f"=== leantune {methods.of(trainer).command} summary ===", f"steps: {trainer.state.global_step} in {seconds:.1f} s",
                     *lines, f"peak memory: {metrics['peak_memory_mb']:.0f} MiB ({metrics['peak_memory_kind']})",
                     f"model saved to: {trainer.args.output_dir}"]))


def online_reward_funcs(reward_args):
    if not reward_args.reward_funcs:
        raise UsageError("--reward_funcs is required with --dataset_name (built-ins: correct_answer, "
                         "characters_in_place; or package.module:function; or a reward model).")
    try:
        return resolve_reward_funcs(reward_args.reward_funcs)
    except ValueError as error:
        raise UsageError(f"--reward_funcs: {error}") from error


def load_splits(script_args, args):
    """(train, eval or None) from --dataset_name, columns renamed by the --<name>_column flags."""
    if script_args.dataset_streaming and args.max_steps <= 0:
        raise UsageError("--dataset_streaming true reads the data as a stream, whose length is not known: set "
                         "--max_steps to the number of optimizer steps to train.")
    try:
        data = load_dataset_source(script_args.dataset_name, script_args.dataset_config,
                                   script_args.dataset_streaming)
    except FileNotFoundError as error:  # the library's message names the path, not the flag that gave it
        raise UsageError(f"--dataset_name {script_args.dataset_name}: {one_line(error)} Give an existing "
                         "json/jsonl/parquet/csv file or folder (paths are relative to the current folder).") from error
    if script_args.dataset_train_split not in data:
        raise UsageError(f"--dataset_train_split {script_args.dataset_train_split}: no such split in "
                         f"{script_args.dataset_name}; it has {list(data)}.")
    evaluation = None
    if args.eval_strategy != "no":
        if script_args.dataset_test_split not in data:
            raise UsageError(f"--eval_strategy {args.eval_strategy} needs an eval split, and --dataset_test_split "
                             f"{script_args.dataset_test_split} is not in {script_args.dataset_name} (splits: "
                             f"{list(data)}); name one with --dataset_test_split, or set --eval_strategy no.")
        evaluation = rename_columns(data[script_args.dataset_test_split], script_args.column_mapping())
    return rename_columns(data[script_args.dataset_train_split], script_args.column_mapping()), evaluation


COLUMN_FLAGS = "--prompt_column, --completion_column, --messages_column, --chosen_column, --rejected_column"


def check_columns(kind: str, dataset, args, split: str) -> None:
    """The method's format check on the raw data (columns and value types), before any model or tokenizer; a stream
    is checked on its first rows."""
    if isinstance(dataset, IterableDataset):
        dataset = Dataset.from_list(list(dataset.take(64)))
    try:
        if kind == SFT_DATA:
            detect_sft_format(dataset, args.dataset_text_field)
        elif kind == PREFERENCE_DATA:
            detect_preference_format(dataset)
        elif kind == KTO_DATA:
            detect_kto_format(dataset)
        elif kind == PROMPT_DATA and "prompt" not in dataset.column_names:
            raise ValueError(f"no 'prompt' column (text or a list of chat messages); columns found: "
                             f"{sorted(dataset.column_names)}.")
    except ValueError as error:
        message = str(error)
        hint = "" if "--prompt_column" in message else f" Other column names can be mapped with {COLUMN_FLAGS}."
        raise UsageError(f"{split} data: {message}{hint}") from error
