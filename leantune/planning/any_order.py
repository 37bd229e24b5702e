"""The batches no shuffle can beat: the micro-batch of the longest rows together, and of the rows with the most
targets together.

The plan's worst batch is the worst of the first epoch under the run's seed, with the step where it arrives. Another
seed or a later epoch shuffles the rows into other batches, and one of them may be larger (measured: a seed-7 run's
step 2 was 0.5% above the seed-42 plan's worst). A step's memory grows with its token slots (activations) and with its
loss targets (the chunked head's work): the `per_device_train_batch_size` rows with the most tokens hold the most
slots any batch can (the longest row is among them) and the rows with the most targets the most targets, so the
larger of their traced peaks bounds every order. Rows are ranked from Arrow's list lengths and flat label buffers,
without decoding them.
"""

from __future__ import annotations

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def longest_rows_batches(trainer) -> list:
    """[(batch, words)] collated as the trainer's loader collates, or [] where the loader's batches are not rows of a
    map-style dataset (online methods' prompts, streams)."""
    dataset = trainer.train_dataset
    size = int(getattr(trainer.args, "per_device_train_batch_size", 1) or 1)
    if not isinstance(dataset, datasets.Dataset) or len(dataset) == 0 or getattr(trainer, "data_collator", None) is None:
        return []
    table = dataset.with_format("arrow")[:]
    ids = [name for name in table.column_names if name.endswith("ids") and name != "position_ids"
           and _is_list(table[name])]
    if not ids:
        return []
    tokens = sum(_lengths(table[name]) for name in ids)
    if "labels" in table.column_names and _is_list(table["labels"]):
        targets = _counts_not(table["labels"], -100)
    else:  # pairs and KTO: the completions' tokens are the targets
        completions = [name for name in ids if not name.startswith("prompt")]
        targets = sum(_lengths(table[name]) for name in completions) if completions else tokens
    found, chosen = [], set()
    for key, what in ((tokens, "tokens"), (targets, "targets")):
        order = tuple(sorted(np.argsort(-key, kind="stable")[:size].tolist()))
        if order in chosen:
            continue
        chosen.add(order)
        rows = dataset.select(order)
        if trainer.args.remove_unused_columns:  # what the Trainer's loader hands the collator
            rows = rows.remove_columns([name for name in rows.column_names if name not in trainer.dataset_columns])
        batch = trainer.data_collator([rows[i] for i in range(len(rows))])
        if isinstance(batch, dict):
            found.append((batch, f"the {len(order)} rows with the most {what} together"))
    return found


def _is_list(column) -> bool:
    return pa.types.is_list(column.type) or pa.types.is_large_list(column.type)


def _lengths(column) -> np.ndarray:
    return np.asarray(pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False), dtype=np.int64)


def _counts_not(column, value) -> np.ndarray:
    """Per row, how many entries of a list column differ from `value`."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    lengths = _lengths(column)
    flat = np.asarray(pc.list_flatten(column).to_numpy(zero_copy_only=False))
    marks = np.concatenate([[0], np.cumsum(flat != value)])
    ends = np.cumsum(lengths)
    return marks[ends] - marks[ends - lengths]
