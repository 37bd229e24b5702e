"""Packing: every token lands where the plan says, layouts are consistent across columns, counts are honest."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from datasets import Dataset, DatasetDict, concatenate_datasets

from leantune.data.packing import (
    PackingPlan,
    _ramp_prefixes,
    _restarting_count,
    best_fit_decreasing,
    pack_dataset,
    plan_packing,
    refill_loose_bins,
)

from ..fixtures.data import gsm8k_rows
from ..fixtures.paths import TOKENIZER_DIR

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def token_dataset(lengths, seed: int = 0) -> Dataset:
    """Sequence i holds globally unique token ids, so every token can be traced back to its source.

    completion_mask is derived from the token (id % 2) and labels are -id, so a column packed with a
    different layout than input_ids is detected token by token.
    """
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = [list(range(int(a), int(b))) for a, b in zip(offsets[:-1], offsets[1:])]
    return Dataset.from_dict(
        {
            "input_ids": ids,
            "completion_mask": [[t % 2 for t in seq] for seq in ids],
            "labels": [[-t for t in seq] for seq in ids],
        }
    )


def random_lengths(n: int, high: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, high + 1, n)


def unpacked_segments(packed: Dataset, column: str = "input_ids") -> list[list]:
    """Cut every packed row back into its segments using seq_lengths."""
    segments = []
    for row, lengths in zip(packed[column], packed["seq_lengths"]):
        start = 0
        for length in lengths:
            segments.append(list(row[start : start + length]))
            start += length
    return segments


def check_layout(packed: Dataset, seq_length: int) -> None:
    """Rows fit, seq_lengths describe the row exactly, position_ids restart at every segment."""
    for ids, lengths, positions in zip(packed["input_ids"], packed["seq_lengths"], packed["position_ids"]):
        assert 0 < len(ids) <= seq_length
        assert all(length > 0 for length in lengths)
        assert sum(lengths) == len(ids) == len(positions)
        assert positions == [p for length in lengths for p in range(length)]


def check_columns_consistent(packed: Dataset) -> None:
    """completion_mask and labels were moved with exactly the layout of input_ids."""
    for ids, mask, labels in zip(packed["input_ids"], packed["completion_mask"], packed["labels"]):
        assert mask == [t % 2 for t in ids]
        assert labels == [-t for t in ids]


def as_multiset(sequences) -> Counter:
    return Counter(tuple(seq) for seq in sequences)


def reference_bfd_loads(sizes, capacity) -> list[int]:
    """Textbook Best-Fit-Decreasing, one item at a time: the sorted loads of the bins."""
    loads: list[int] = []
    for size in sorted(sizes, reverse=True):
        fitting = [b for b, load in enumerate(loads) if load + size <= capacity]
        if fitting:
            best = max(fitting, key=lambda b: loads[b])
            loads[best] += size
        else:
            loads.append(size)
    return sorted(loads)


# ------------------------------------------------------------------------------------------------
# Real data: gsm8k tokenised with the Mistral tokenizer
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k_tokens() -> Dataset:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    rows = gsm8k_rows(3000)
    prompts = tokenizer([r["question"] for r in rows], return_attention_mask=False)["input_ids"]
    answers = tokenizer([" " + r["answer"] for r in rows], add_special_tokens=False, return_attention_mask=False)
    answers = answers["input_ids"]
    return Dataset.from_dict(
        {
            "input_ids": [p + a for p, a in zip(prompts, answers)],
            "completion_mask": [[0] * len(p) + [1] * len(a) for p, a in zip(prompts, answers)],
            "question": [r["question"] for r in rows],
        }
    )


def test_bfd_on_gsm8k_preserves_every_example_and_is_near_optimal(gsm8k_tokens):
    seq_length = 1024
    packed = pack_dataset(gsm8k_tokens, seq_length)

    check_layout(packed, seq_length)
    assert packed.column_names == ["input_ids", "completion_mask", "seq_lengths", "position_ids"]
    pairs = zip(unpacked_segments(packed, "input_ids"), unpacked_segments(packed, "completion_mask"))
    original = zip(gsm8k_tokens["input_ids"], gsm8k_tokens["completion_mask"])
    assert Counter((tuple(i), tuple(m)) for i, m in pairs) == Counter((tuple(i), tuple(m)) for i, m in original)

    lengths = np.array([len(ids) for ids in gsm8k_tokens["input_ids"]])
    lower_bound = -(-int(lengths.sum()) // seq_length)
    assert len(packed) <= lower_bound * 1.01 + 1  # plain BFD needs 561 rows for 553 here
    assert plan_packing(lengths, seq_length).num_rows == len(packed)


@pytest.mark.parametrize("strategy", ["bfd_split", "wrapped"])
def test_gsm8k_tokens_are_all_kept_by_splitting_strategies(gsm8k_tokens, strategy):
    subset = gsm8k_tokens.select(range(1000))
    packed = pack_dataset(subset, 256, strategy=strategy)  # about 1 in 6 gsm8k examples is longer than 256
    check_layout(packed, 256)
    for column in ["input_ids", "completion_mask"]:
        if strategy == "wrapped":
            assert [t for row in packed[column] for t in row] == [t for seq in subset[column] for t in seq]
        else:
            chunks = [seq[i : i + 256] for seq in subset[column] for i in range(0, len(seq), 256)]
            assert as_multiset(unpacked_segments(packed, column)) == as_multiset(chunks)


# ------------------------------------------------------------------------------------------------
# bfd
# ------------------------------------------------------------------------------------------------


def test_bfd_keeps_every_sequence_and_packs_columns_consistently():
    data = token_dataset(random_lengths(500, 64, seed=1))
    packed = pack_dataset(data, 64)

    check_layout(packed, 64)
    check_columns_consistent(packed)
    assert as_multiset(unpacked_segments(packed)) == as_multiset(data["input_ids"])
    assert as_multiset(unpacked_segments(packed, "labels")) == as_multiset(data["labels"])


def test_bfd_truncates_over_long_sequences_keeping_their_start_and_reports_it(caplog):
    lengths = np.array([3, 10, 4, 7, 1, 12])
    data = token_dataset(lengths)
    with caplog.at_level(logging.WARNING, logger="leantune.data.packing"):
        packed = pack_dataset(data, 5)

    check_layout(packed, 5)
    check_columns_consistent(packed)
    assert as_multiset(unpacked_segments(packed)) == as_multiset(seq[:5] for seq in data["input_ids"])
    plan = plan_packing(lengths, 5)
    assert (plan.num_truncated, plan.tokens_dropped) == (3, 5 + 2 + 7)
    assert "truncated 3 sequences" in caplog.text and "dropping 14 tokens" in caplog.text


def test_bfd_bin_loads_match_textbook_best_fit_decreasing():
    rng = np.random.default_rng(3)
    for capacity, high, n in [(10, 10, 60), (64, 40, 300), (100, 7, 400), (512, 511, 200)]:
        sizes = rng.integers(1, high + 1, n)
        order, offsets = best_fit_decreasing(sizes, capacity)
        assert sorted(order.tolist()) == list(range(n))
        loads = sorted(int(sizes[order[a:b]].sum()) for a, b in zip(offsets[:-1], offsets[1:]))
        assert loads == reference_bfd_loads(sizes.tolist(), capacity)


def test_loose_bins_are_refilled_below_plain_bfd_on_medium_sized_items():
    sizes = np.random.default_rng(8).integers(60, 400, 3000)
    _, bfd_offsets = best_fit_decreasing(sizes, 1024)
    order, offsets = refill_loose_bins(sizes, *best_fit_decreasing(sizes, 1024), 1024)
    lower_bound = -(-int(sizes.sum()) // 1024)
    assert len(offsets) - 1 < len(bfd_offsets) - 1
    assert len(offsets) - 1 <= lower_bound + 1
    assert sorted(order.tolist()) == list(range(3000))
    assert all(sizes[order[a:b]].sum() <= 1024 for a, b in zip(offsets[:-1], offsets[1:]))


def test_refilling_that_runs_out_of_work_budget_still_packs_every_item_once():
    sizes = np.random.default_rng(9).integers(60, 400, 3000)
    bfd_order, bfd_offsets = best_fit_decreasing(sizes, 1024)
    order, offsets = refill_loose_bins(sizes, bfd_order, bfd_offsets, 1024, work_budget=20_000)
    assert sorted(order.tolist()) == list(range(3000))
    assert all(sizes[order[a:b]].sum() <= 1024 for a, b in zip(offsets[:-1], offsets[1:]))
    assert len(offsets) <= len(bfd_offsets)


def test_bfd_places_items_largest_first_within_each_row():
    plan = plan_packing(np.array([2, 9, 4, 1, 6, 3]), 10)
    for a, b in zip(plan.row_offsets[:-1], plan.row_offsets[1:]):
        lengths = plan.segment_length[a:b].tolist()
        assert lengths == sorted(lengths, reverse=True)
    assert plan.row_lengths.tolist() == [10, 10, 5]


def test_bfd_fill_ratio_is_near_optimal_on_realistic_lengths():
    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(400) - 0.5, 1.0, 50_000).round(), 1, 8000)
    plan = plan_packing(lengths.astype(np.int64), 2048)
    lower_bound = -(-plan.num_tokens // 2048)
    assert plan.num_rows <= lower_bound * 1.01 + 1
    assert plan.fill_ratio >= 0.99


# ------------------------------------------------------------------------------------------------
# bfd_split and wrapped
# ------------------------------------------------------------------------------------------------


def test_bfd_split_keeps_every_token_and_chunks_rebuild_each_sequence():
    lengths = np.concatenate([random_lengths(200, 30, seed=2), [31, 64, 65, 200]])
    data = token_dataset(lengths)
    packed = pack_dataset(data, 32, strategy="bfd_split")

    check_layout(packed, 32)
    check_columns_consistent(packed)
    chunks = unpacked_segments(packed)
    assert all(len(chunk) <= 32 for chunk in chunks)
    # Tokens are unique and consecutive within a sequence: chunks sorted by first token rebuild the stream.
    rebuilt = [t for chunk in sorted(chunks, key=lambda c: c[0]) for t in chunk]
    assert rebuilt == list(range(int(lengths.sum())))
    chunk_starts = {chunk[0] for chunk in chunks}
    for seq in data["input_ids"]:
        assert {seq[i] for i in range(0, len(seq), 32)} <= chunk_starts
    assert sum(len(c) for c in chunks) == lengths.sum()


def test_wrapped_rows_concatenate_to_the_sequences_in_order():
    lengths = random_lengths(300, 50, seed=4)
    data = token_dataset(lengths)
    packed = pack_dataset(data, 40, strategy="wrapped")

    check_layout(packed, 40)
    check_columns_consistent(packed)
    rows = packed["input_ids"]
    assert [t for row in rows for t in row] == [t for seq in data["input_ids"] for t in seq]
    assert all(len(row) == 40 for row in rows[:-1])
    # A segment ends exactly where a sequence ends or a row ends.
    sequence_ends = set(np.cumsum(lengths).tolist())
    position = 0
    for lengths_in_row in packed["seq_lengths"]:
        row_end = position + sum(lengths_in_row)
        for length in lengths_in_row:
            position += length
            assert position in sequence_ends or position == row_end


# ------------------------------------------------------------------------------------------------
# Inputs: empty sequences, dropped columns, shuffled / sliced / chunked tables, dtypes, formats
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_empty_sequences_are_dropped_and_counted(strategy, caplog):
    data = token_dataset([3, 0, 4, 0, 0, 2])
    with caplog.at_level(logging.INFO, logger="leantune.data.packing"):
        packed = pack_dataset(data, 4, strategy=strategy)
    check_layout(packed, 4)
    assert sum(map(len, packed["input_ids"])) == 9
    assert plan_packing(np.array([3, 0, 4, 0, 0, 2]), 4, strategy).num_empty == 3
    assert "dropped 3 empty sequences" in caplog.text


def test_non_list_columns_are_dropped_with_a_log_and_layout_columns_recomputed(caplog):
    data = token_dataset([2, 3]).add_column("text", ["a", "b"]).add_column("score", [1.0, 2.0])
    data = data.add_column("position_ids", [[7, 7], [7, 7, 7]])
    with caplog.at_level(logging.INFO, logger="leantune.data.packing"):
        packed = pack_dataset(data, 8)
    assert packed.column_names == ["input_ids", "completion_mask", "labels", "seq_lengths", "position_ids"]
    assert "['text', 'score']" in caplog.text
    assert packed["position_ids"] == [[0, 1, 2, 0, 1]]


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_shuffled_sliced_and_multi_chunk_datasets_pack_like_their_flat_copy(strategy):
    lengths = random_lengths(400, 40, seed=5)
    base = token_dataset(lengths)
    chunked = concatenate_datasets([base.select(range(0, 150)), base.select(range(150, 400))])
    assert chunked.data.table.column("input_ids").num_chunks > 1
    variants = [
        base.shuffle(seed=0),  # indices mapping
        base.select(range(37, 311)),  # contiguous slice of the table
        chunked.shuffle(seed=1),
        chunked.select([5, 5, 9, 399, 0, 200, 5]),  # duplicates
    ]
    for data in variants:
        packed = pack_dataset(data, 32, strategy=strategy)
        expected = pack_dataset(data.flatten_indices(), 32, strategy=strategy)
        assert packed["input_ids"] == expected["input_ids"]
        assert packed["seq_lengths"] == expected["seq_lengths"]
        check_layout(packed, 32)
        check_columns_consistent(packed)
        if strategy == "wrapped":
            assert [t for row in packed["input_ids"] for t in row] == [t for s in data["input_ids"] for t in s]
        else:
            keep = 32 if strategy == "bfd" else None
            kept = [t for s in data["input_ids"] for t in s[:keep]]
            assert Counter(t for row in packed["input_ids"] for t in row) == Counter(kept)


def test_value_dtypes_are_kept_including_types_arrow_cannot_view_as_bytes():
    ids = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    table = pa.table(
        {
            "input_ids": pa.array(ids, type=pa.list_(pa.int64())),
            "mask": pa.array([[1, 0, 1, 0, 1], [1, 1], [0, 0, 1]], type=pa.list_(pa.int8())),
            "flags": pa.array([[True, False, True, True, False], [False, True], [True, True, False]]),
            "weights": pa.array(
                [[0.5, None, 1.0, 2.0, 3.0], [1.5, 2.5], [None, 0.0, 1.0]], type=pa.list_(pa.float32())
            ),
            "nested": pa.array([[[i] for i in seq] for seq in ids]),
            "large": pa.array(ids, type=pa.large_list(pa.int16())),
        }
    )
    data = Dataset(table)
    for strategy in ["bfd", "bfd_split", "wrapped"]:
        packed = pack_dataset(data, 4, strategy=strategy)
        schema = packed.data.table.schema
        for name in table.column_names:
            assert schema.field(name).type == table.schema.field(name).type
        for name in table.column_names:
            rows = unpacked_segments(packed, name)
            tokens = unpacked_segments(packed, "input_ids")
            by_token = {t: v for seq, values in zip(ids, table.column(name).to_pylist()) for t, v in zip(seq, values)}
            assert all(by_token[t] == v for seg, vals in zip(tokens, rows) for t, v in zip(seg, vals))


def test_dataset_dict_packs_every_split_and_format_is_kept():
    splits = DatasetDict({"train": token_dataset([3, 4, 5]), "test": token_dataset([6, 1])})
    splits = splits.with_format("numpy", columns=["input_ids", "completion_mask"])
    packed = pack_dataset(splits, 8, strategy="bfd")
    assert isinstance(packed, DatasetDict) and set(packed) == {"train", "test"}
    assert [len(packed["train"]), len(packed["test"])] == [2, 1]
    assert packed["train"].format["type"] == "numpy"
    assert set(packed["train"][0]) == {"input_ids", "completion_mask", "seq_lengths", "position_ids"}


def test_output_rows_and_fill_ratio_are_exactly_the_plan():
    lengths = random_lengths(1000, 300, seed=6)
    for strategy in ["bfd", "bfd_split", "wrapped"]:
        plan = plan_packing(lengths, 256, strategy)
        packed = pack_dataset(token_dataset(lengths), 256, strategy=strategy)
        assert isinstance(plan, PackingPlan)
        assert len(packed) == plan.num_rows
        assert [len(row) for row in packed["input_ids"]] == plan.row_lengths.tolist()
        tokens = sum(len(row) for row in packed["input_ids"])
        assert plan.fill_ratio == pytest.approx(tokens / (len(packed) * 256))  # float64 ratio of counts: ulps


def test_plan_describes_the_packed_rows_exactly():
    lengths = np.concatenate([random_lengths(300, 70, seed=10), [0, 0]])
    data = token_dataset(lengths)
    for strategy in ["bfd", "bfd_split", "wrapped"]:
        plan = plan_packing(lengths, 64, strategy)
        rows_from_plan = []
        for a, b in zip(plan.row_offsets[:-1], plan.row_offsets[1:]):
            row = []
            for j in range(a, b):
                source, start = data[int(plan.segment_source[j])]["input_ids"], int(plan.segment_start[j])
                row += source[start : start + int(plan.segment_length[j])]
            rows_from_plan.append(row)
        packed = pack_dataset(data, 64, strategy=strategy)
        assert packed["input_ids"] == rows_from_plan
        assert packed["seq_lengths"] == [
            plan.segment_length[a:b].tolist() for a, b in zip(plan.row_offsets[:-1], plan.row_offsets[1:])
        ]


def test_columns_whose_values_start_inside_a_shared_buffer_are_read_from_the_right_place():
    values = pa.array(np.arange(100, dtype=np.int64)).slice(10)  # the list column's values have an offset
    ids = pa.ListArray.from_arrays(pa.array([0, 3, 5, 9, 16], type=pa.int32()), values)
    data = Dataset(pa.table({"input_ids": ids}))
    packed = pack_dataset(data, 8)
    assert as_multiset(unpacked_segments(packed)) == as_multiset(ids.to_pylist())
    assert sorted(t for row in packed["input_ids"] for t in row) == list(range(10, 26))


def test_position_fallback_matches_the_arrow_path():
    lengths = np.concatenate([[1, 2, 3, 4, 1, 1, 5], random_lengths(2000, 64, seed=7)])
    assert np.array_equal(_ramp_prefixes(lengths, 64), _restarting_count(lengths))
    assert _ramp_prefixes(lengths, 64)[:16].tolist() == [0, 0, 1, 0, 1, 2, 0, 1, 2, 3, 0, 0, 0, 1, 2, 3]


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def test_unknown_strategy_names_the_accepted_ones():
    with pytest.raises(ValueError, match="bfd, bfd_split, wrapped"):
        pack_dataset(token_dataset([2]), 4, strategy="first_fit")
    with pytest.raises(ValueError, match="bfd, bfd_split, wrapped"):
        plan_packing(np.array([2]), 4, strategy="ffd")


@pytest.mark.parametrize("seq_length", [0, -3, 2.5])
def test_seq_length_must_be_a_positive_integer(seq_length):
    with pytest.raises(ValueError, match="seq_length"):
        pack_dataset(token_dataset([2]), seq_length)


def test_empty_dataset_and_dataset_without_lists_are_rejected():
    with pytest.raises(ValueError, match="empty dataset"):
        pack_dataset(token_dataset([2]).select([]), 4)
    with pytest.raises(ValueError, match="list column"):
        pack_dataset(Dataset.from_dict({"text": ["a", "b"]}), 4)


def test_list_columns_of_different_lengths_are_rejected():
    data = Dataset.from_dict({"input_ids": [[1, 2], [3]], "labels": [[1, 2], [3, 4]]})
    with pytest.raises(ValueError, match="'labels'.*row 1"):
        pack_dataset(data, 4)
