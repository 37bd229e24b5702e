"""`leantune profile`: token lengths of a dataset under a tokenizer, and the max_length and packing to choose."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from ..profiling import profile_dataset
from ..profiling.figure import write_length_figure
from .arguments import ColumnArguments
from .parser import parse_command_args

FIGURE_NAME = "length_profile.png"
JSON_NAME = "length_profile.json"


@dataclass
class ProfileArguments(ColumnArguments):
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Hub dataset name, local folder, or json/jsonl/parquet/csv file (comma-separate several)."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to profile."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer id on the Hub or local folder."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Used as the tokenizer when --tokenizer is not given."}
    )
    chat_template_path: str | None = field(
        default=None, metadata={"help": "A Jinja chat-template file (or tokenizer dir) to use instead of the tokenizer's."}
    )
    dataset_text_field: str = field(default="text", metadata={"help": "Column holding text for language-modelling data."})
    eos_token: str | None = field(default=None, metadata={"help": "EOS token appended to each example (default: tokenizer's)."})
    max_lengths: list[int] | None = field(
        default=None, metadata={"help": "Candidate max_length values (default: powers of two around the data)."}
    )
    batch_size: int = field(default=8, metadata={"help": "Examples per batch (per_device_train_batch_size)."})
    keep_threshold: float = field(
        default=0.99,
        metadata={"help": "Recommend the smallest multiple of 64 keeping at least this share of tokens (0.99 = 99%%)."},
    )
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Pad each batch to a multiple of this."})
    num_proc: int | None = field(default=None, metadata={"help": "Tokenisation processes (default: all cores)."})
    seed: int = field(default=42, metadata={"help": "Seed of the random batches used for padding numbers."})
    max_examples: int | None = field(default=None, metadata={"help": "Profile only the first N examples."})
    output_dir: str = field(
        default="leantune-output/profile", metadata={"help": f"Where {FIGURE_NAME} and {JSON_NAME} are written."}
    )
    figure: bool = field(default=True, metadata={"help": f"Write {FIGURE_NAME} (false: only the JSON)."})



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
