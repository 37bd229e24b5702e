"""`leantune profile`: token lengths of a dataset under a tokenizer, and the max_length and packing to choose."""

from __future__ import annotations

import os
import sys

from ..profiling import profile_dataset
from ..profiling.figure import write_length_figure
from .arguments import FIGURE_NAME, JSON_NAME, ProfileArguments
from .parser import parse_command_args


def run(argv: list[str]) -> int:
    # the profile command's own options (ProfileArguments), not a trainer's config
    (options, _explicit) = parse_command_args("leantune profile", (ProfileArguments,), argv)
    tokenizer = options.tokenizer or options.model_name_or_path
    if options.dataset_name is None or tokenizer is None:
        missing = "--dataset_name" if options.dataset_name is None else "--tokenizer (or --model_name_or_path)"
        print(f"leantune profile: {missing} is required.", file=sys.stderr)
        return 2

    try:
        profile = profile_dataset(
            options.dataset_name, tokenizer, max_lengths=options.max_lengths, batch_size=options.batch_size,
            keep_threshold=options.keep_threshold, pad_to_multiple_of=options.pad_to_multiple_of,
            dataset_text_field=options.dataset_text_field, column_mapping=options.column_mapping(),
            chat_template_path=options.chat_template_path, eos_token=options.eos_token, num_proc=options.num_proc,
            seed=options.seed, max_examples=options.max_examples, dataset_config=options.dataset_config,
            split=options.dataset_train_split,
        )
    except (ValueError, FileNotFoundError, TypeError) as error:
        print(f"leantune profile: {error}", file=sys.stderr)
        return 2
    os.makedirs(options.output_dir, exist_ok=True)
    written = []
    if options.figure:
        written.append(write_length_figure(profile, os.path.join(options.output_dir, FIGURE_NAME)))
    json_path = os.path.join(options.output_dir, JSON_NAME)
    profile.to_json(json_path)
    written.append(json_path)
    print(profile.format_text())
    seconds = profile.seconds
    print(f"written: {', '.join(written)} (tokenising {seconds['tokenise']:.1f} s, report {seconds['report']:.1f} s)")
    return 0
