"""`leantune profile`: token lengths of a dataset under a tokenizer, and the max_length and packing to choose."""

from __future__ import annotations

import os
import sys

from ..profiling import profile_dataset
from ..profiling.figure import write_length_figure
from .arguments import FIGURE_NAME, JSON_NAME, ProfileArguments
from .parser import parse_command_args


def run(argv: list[str]) -> int:
    (args, _explicit) = parse_command_args("leantune profile", (ProfileArguments,), argv)
    tokenizer = args.tokenizer or args.model_name_or_path
    if args.dataset_name is None or tokenizer is None:
        missing = "--dataset_name" if args.dataset_name is None else "--tokenizer (or --model_name_or_path)"
        print(f"leantune profile: {missing} is required.", file=sys.stderr)
        return 2

    try:
        profile = profile_dataset(
            args.dataset_name, tokenizer, max_lengths=args.max_lengths, batch_size=args.batch_size,
            keep_threshold=args.keep_threshold, pad_to_multiple_of=args.pad_to_multiple_of,
            dataset_text_field=args.dataset_text_field, column_mapping=args.column_mapping(),
            chat_template_path=args.chat_template_path, eos_token=args.eos_token, num_proc=args.num_proc,
            seed=args.seed, max_examples=args.max_examples, dataset_config=args.dataset_config,
            split=args.dataset_train_split,
        )
    except (ValueError, FileNotFoundError, TypeError) as error:
        print(f"leantune profile: {error}", file=sys.stderr)
        return 2
    os.makedirs(args.output_dir, exist_ok=True)
    written = []
    if args.figure:
        written.append(write_length_figure(profile, os.path.join(args.output_dir, FIGURE_NAME)))
    json_path = os.path.join(args.output_dir, JSON_NAME)
    profile.to_json(json_path)
    written.append(json_path)
    print(profile.format_text())
    seconds = profile.seconds
    print(f"written: {', '.join(written)} (tokenising {seconds['tokenise']:.1f} s, report {seconds['report']:.1f} s)")
    return 0
