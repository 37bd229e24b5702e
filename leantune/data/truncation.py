"""Truncation of tokenised list columns, done on Arrow buffers and counted."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def list_columns(dataset) -> list[str]:
    """Names of the columns that hold one list of tokens (or token flags) per example."""
    names = []
    for name, feature in dataset.features.items():
        if type(feature).__name__ in ("List", "Sequence", "LargeList") or isinstance(feature, list):
            names.append(name)
    return names


def sequence_lengths(dataset, column: str = "input_ids") -> np.ndarray:
    table = dataset.with_format("arrow")[:][column] if len(dataset) else pa.array([], pa.list_(pa.int64()))
    return pc.list_value_length(table).to_numpy(zero_copy_only=False).astype(np.int64)


def truncate_dataset(dataset, max_length: int, mode: str = "keep_start", num_proc: int | None = None):
    """Cut every list column to max_length tokens. Returns (dataset, num_truncated, tokens_dropped)."""
    lengths = sequence_lengths(dataset)
    over = lengths > max_length
    num_truncated = int(over.sum())
    tokens_dropped = int((lengths[over] - max_length).sum())
    if num_truncated == 0:
        return dataset, 0, 0
    columns = list_columns(dataset)

    def cut(batch: pa.Table) -> pa.Table:
        for name in columns:
            array = batch[name].combine_chunks()
            if mode == "keep_start":
                sliced = pc.list_slice(array, 0, max_length)
            else:
                sliced = _keep_end(array, max_length)
            batch = batch.set_column(batch.schema.get_field_index(name), name, sliced)
        return batch

    dataset = dataset.with_format("arrow").map(cut, batched=True, num_proc=num_proc, desc="Truncating")
    return dataset.with_format(None), num_truncated, tokens_dropped


def _keep_end(array: pa.ListArray, max_length: int) -> pa.ListArray:
    lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
    offsets = array.offsets.to_numpy()
    starts = offsets[:-1] + np.maximum(lengths - max_length, 0)
    keep = np.minimum(lengths, max_length)
    new_offsets = np.concatenate([[0], np.cumsum(keep)]).astype(np.int32)
    index = np.repeat(starts - np.concatenate([[0], np.cumsum(keep)[:-1]]), keep) + np.arange(keep.sum())
    values = array.values.take(pa.array(index))
    return pa.ListArray.from_arrays(pa.array(new_offsets, pa.int32()), values)
