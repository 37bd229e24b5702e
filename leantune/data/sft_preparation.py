"""The SFT data recipe: format check, empty-row filter, tokenisation, truncation, packing; every drop counted."""

from __future__ import annotations

import logging

import numpy as np

from .chat_template import require_chat_template
from .collators import IGNORE_INDEX
from .formats import SFTFormat, detect_sft_format, from_sharegpt
from .lengths import length_summary_line
from .packing import pack_dataset
from .report import NothingLeft, SFTReport
from .sft_tokenization import SFTTokenizer, is_empty_example
from .streaming import STREAM_BUFFER_ROWS, without_shuffle
from .truncation import sequence_lengths, truncate_dataset

logger = logging.getLogger("leantune.data")
LOSS_MASK_COLUMNS = ("completion_mask", "assistant_masks")


def sft_stream_order(stream, split: str, args):
    """(stream, config of its buffers): a train stream with `shuffle_dataset` goes through datasets' buffered shuffle
    (seeded), and its buffers are then prepared without shuffling again."""
    if args.shuffle_dataset and split == "train":
        stream = stream.shuffle(seed=args.seed, buffer_size=STREAM_BUFFER_ROWS)
    return stream, without_shuffle(args)


def prepare_sft_dataset(dataset, tokenizer, args, split: str = "train", formatting_func=None, packing: bool = False):
    """Return (tokenised dataset, SFTReport) ready for the SFT collator."""
    if dataset is None:
        return None, None
    if type(dataset).__name__ in ("DatasetDict", "IterableDatasetDict"):
        raise ValueError(f"Pass one split as the {split} dataset, not a DatasetDict with {list(dataset)}.")
    report = SFTReport(split=split, num_examples_in=len(dataset))
    if report.num_examples_in == 0:
        raise ValueError(f"The {split} dataset is empty.")
    num_proc = args.dataset_num_proc
    dataset = from_sharegpt(dataset)
    if formatting_func is not None:
        dataset = dataset.map(lambda ex: {"text": formatting_func(ex)}, remove_columns=dataset.column_names, num_proc=num_proc)
        text_field = "text"
    else:
        text_field = args.dataset_text_field
    fmt = detect_sft_format(dataset, text_field)
    _check_format_against_args(fmt, tokenizer, args, dataset)

    if fmt is not SFTFormat.TOKENIZED:
        def not_empty(batch):
            size = len(next(iter(batch.values())))
            return {"__keep__": [not is_empty_example({k: batch[k][i] for k in batch}, fmt, text_field) for i in range(size)]}

        keep = dataset.map(
            not_empty, batched=True, remove_columns=dataset.column_names, num_proc=num_proc, desc="Checking rows"
        )["__keep__"]
        dataset = dataset.select(np.flatnonzero(keep)) if not all(keep) else dataset
        report.num_empty_dropped = report.num_examples_in - len(dataset)
        if len(dataset) == 0:
            raise NothingLeft(f"Every example of the {split} dataset is empty.", report)
        eos_id = tokenizer.convert_tokens_to_ids(args.eos_token) if args.eos_token else tokenizer.eos_token_id
        encode = SFTTokenizer(tokenizer, fmt, text_field, args.assistant_only_loss, eos_id)
        dataset = dataset.map(
            encode, batched=True, remove_columns=dataset.column_names, num_proc=num_proc, desc=f"Tokenising {split}"
        )
    else:
        non_empty = [i for i, ids in enumerate(dataset["input_ids"]) if ids]
        report.num_empty_dropped = len(dataset) - len(non_empty)
        if report.num_empty_dropped:
            dataset = dataset.select(non_empty)

    dataset = bake_labels(dataset, args, num_proc)
    splits_long = packing and args.packing_strategy in ("bfd_split", "wrapped")
    logger.info(length_summary_line(sequence_lengths(dataset), args.max_length, split, truncates=not splits_long))
    if args.max_length is not None and not splits_long:
        dataset, report.num_truncated, report.tokens_dropped = truncate_dataset(
            dataset, args.max_length, args.truncation_mode, num_proc
        )
    dataset, report.num_without_targets_dropped = drop_examples_without_targets(dataset, num_proc)
    report.num_examples_out = len(dataset)
    if len(dataset) == 0:
        raise NothingLeft(f"No {split} example has a token to learn from after preparation: {report.as_dict()}.",
                          report)
    if args.shuffle_dataset and split == "train":
        dataset = dataset.shuffle(seed=args.seed)
    if packing:
        dataset = pack_dataset(dataset, args.max_length, strategy=args.packing_strategy)
    report.num_rows_out = len(dataset)
    report.log()
    return dataset, report


def _check_format_against_args(fmt: SFTFormat, tokenizer, args, dataset) -> None:
    conversational = fmt in (SFTFormat.CONVERSATIONAL, SFTFormat.CONVERSATIONAL_PROMPT_COMPLETION)
    if conversational:
        require_chat_template(tokenizer)
    if args.assistant_only_loss:
        if fmt is SFTFormat.TOKENIZED:
            if "assistant_masks" not in dataset.column_names:
                raise ValueError("`assistant_only_loss` with pre-tokenised data needs an 'assistant_masks' column; "
                                 f"columns found: {sorted(dataset.column_names)}.")
        elif not conversational:
            raise ValueError(
                f"`assistant_only_loss` needs conversational data (a 'messages' column, or prompt/completion message "
                f"lists); this dataset is {fmt.value}, columns {sorted(dataset.column_names)}. Map a column with "
                "`messages_column`, or turn `assistant_only_loss` off."
            )
    has_completion = fmt in (SFTFormat.PROMPT_COMPLETION, SFTFormat.CONVERSATIONAL_PROMPT_COMPLETION) or (
        fmt is SFTFormat.TOKENIZED and "completion_mask" in dataset.column_names
    )
    if args.completion_only_loss and not has_completion:
        raise ValueError(
            f"`completion_only_loss` needs prompt-completion data (or a 'completion_mask' column); this dataset is "
            f"{fmt.value}, columns {sorted(dataset.column_names)}. Set `completion_only_loss` to None or false, or "
            "map columns with `prompt_column` / `completion_column`."
        )


def loss_mask_columns(dataset, args) -> list[str]:
    """The mask columns that select loss tokens under the current settings: `completion_mask` unless
    completion_only_loss is False, `assistant_masks` whenever present (tokenisation writes it only for
    assistant_only_loss; in pre-tokenised data the user gave it to be used), as in TRL."""
    names = []
    if args.completion_only_loss is not False and "completion_mask" in dataset.column_names:
        names.append("completion_mask")
    if "assistant_masks" in dataset.column_names:
        names.append("assistant_masks")
    return names


def bake_labels(dataset, args, num_proc=None):
    """TRL's prepared form: a `labels` column (the token where its masks allow it, -100 elsewhere) in place of the
    mask columns, so truncation and packing carry the targets like any token column. A `labels` column the data
    already has is kept as it is (the masks beside it are dropped)."""
    masks = loss_mask_columns(dataset, args)
    dropped = [name for name in LOSS_MASK_COLUMNS if name in dataset.column_names]
    if "labels" in dataset.column_names:
        return dataset.remove_columns(dropped) if dropped else dataset

    def labels(batch):
        out = []
        for i, ids in enumerate(batch["input_ids"]):
            keep = np.ones(len(ids), dtype=bool)
            for name in masks:
                keep &= np.asarray(batch[name][i], dtype=bool)
            out.append(np.where(keep, np.asarray(ids, dtype=np.int64), IGNORE_INDEX).tolist())
        return {"labels": out}

    return dataset.map(labels, batched=True, remove_columns=dropped, num_proc=num_proc, desc="Building labels")


def drop_examples_without_targets(dataset, num_proc=None):
    """An example whose labels select no predicted token (position >= 1) would add nothing: drop, count."""

    def has_target(batch):
        return {"__keep__": [any(label != IGNORE_INDEX for label in labels[1:]) for labels in batch["labels"]]}

    keep = dataset.map(
        has_target, batched=True, remove_columns=dataset.column_names, num_proc=num_proc, desc="Checking targets"
    )["__keep__"]
    if all(keep):
        return dataset, 0
    return dataset.select(np.flatnonzero(keep)), len(keep) - int(np.sum(keep))
