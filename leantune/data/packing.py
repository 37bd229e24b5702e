"""Pack tokenised sequences into fixed-capacity rows, working on the Arrow buffers directly.

Packing is split in two steps so that anything that needs row counts (a sequence-length profiler, a
trainer sizing its schedule) can run exactly the trainer's arithmetic without touching token data:

1. `plan_packing` decides, from sequence lengths alone, which piece of which sequence goes into which
   output row (a `PackingPlan`).
2. `pack_dataset` applies that plan to every list column of a `datasets.Dataset` with a handful of
   vectorised Arrow/numpy operations (no per-example Python loop) and adds `seq_lengths` and
   `position_ids`.

Strategies (names and meaning follow TRL's `pack_dataset`):

- ``"bfd"``: Best-Fit-Decreasing over the whole dataset (plus a bounded repacking of the rows it left
  loose, see `refill_loose_bins`). Sequences longer than `seq_length` keep their first `seq_length`
  tokens; the rest is dropped, counted and logged.
- ``"bfd_split"``: like ``"bfd"``, but over-long sequences are cut into chunks of at most `seq_length`
  tokens that are packed as separate segments, so no token is lost.
- ``"wrapped"``: all sequences concatenated in dataset order and cut every `seq_length` tokens; a
  sequence crossing a row boundary becomes two segments.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.fingerprint import Hasher

from . import streaming

logger = logging.getLogger(__name__)

STRATEGIES = ("bfd", "bfd_split", "wrapped")
# Columns that describe a packed row's layout: always recomputed, never packed from the input.
LAYOUT_COLUMNS = ("seq_lengths", "position_ids")
_INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True)
class PackingPlan:
    """Where every token of every output row comes from, decided from sequence lengths only.

    Output row ``r`` is made of segments ``row_offsets[r]:row_offsets[r + 1]``; segment ``j`` is the
    tokens ``segment_start[j] : segment_start[j] + segment_length[j]`` of input sequence
    ``segment_source[j]``. Segments are listed in output order.
    """

    seq_length: int
    strategy: str
    segment_source: np.ndarray
    segment_start: np.ndarray
    segment_length: np.ndarray
    row_offsets: np.ndarray
    num_sequences: int
    num_truncated: int = 0
    tokens_dropped: int = 0
    num_empty: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    @property
    def num_segments(self) -> int:
        return len(self.segment_length)

    @property
    def num_tokens(self) -> int:
        """Tokens kept in the packed rows."""
        return int(self.segment_length.sum())

    @property
    def row_lengths(self) -> np.ndarray:
        token_offsets = _exclusive_cumsum(self.segment_length, include_total=True)
        return token_offsets[self.row_offsets[1:]] - token_offsets[self.row_offsets[:-1]]

    @property
    def fill_ratio(self) -> float:
        """Kept tokens / (rows * seq_length): the share of the packed batch that is not padding."""
        if self.num_rows == 0:
            return 0.0
        return self.num_tokens / (self.num_rows * self.seq_length)

    def summary(self) -> str:
        return (
            f"packed {self.num_sequences} sequences into {self.num_rows} rows of <= {self.seq_length} tokens "
            f"(strategy={self.strategy!r}, fill ratio {self.fill_ratio:.4f}, {self.num_truncated} truncated, "
            f"{self.tokens_dropped} tokens dropped, {self.num_empty} empty sequences dropped)"
        )


# --------------------------------------------------------------------------------------------------
# Planning (lengths only)
# --------------------------------------------------------------------------------------------------


def plan_packing(lengths: np.ndarray, seq_length: int, strategy: str = "bfd") -> PackingPlan:
    """Decide the packed layout of sequences with the given lengths; see the module docstring."""
    _check_strategy(strategy)
    _check_seq_length(seq_length)
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {lengths.shape}.")
    if lengths.size and lengths.min() < 0:
        raise ValueError("lengths must be non-negative.")

    sources = np.flatnonzero(lengths > 0)
    num_empty = len(lengths) - len(sources)
    source_lengths = lengths[sources]
    facts = dict(seq_length=seq_length, strategy=strategy, num_sequences=len(lengths), num_empty=num_empty)

    if strategy == "wrapped":
        return PackingPlan(**_plan_wrapped(sources, source_lengths, seq_length), **facts)

    if strategy == "bfd":
        too_long = source_lengths > seq_length
        facts["num_truncated"] = int(too_long.sum())
        facts["tokens_dropped"] = int((source_lengths[too_long] - seq_length).sum())
        item_source = sources
        item_start = np.zeros_like(sources)
        item_length = np.minimum(source_lengths, seq_length)
    else:  # bfd_split
        item_source, item_start, item_length = _split_into_chunks(sources, source_lengths, seq_length)

    item_order, row_offsets = best_fit_decreasing(item_length, seq_length)
    item_order, row_offsets = refill_loose_bins(item_length, item_order, row_offsets, seq_length)
    return PackingPlan(
        segment_source=item_source[item_order],
        segment_start=item_start[item_order],
        segment_length=item_length[item_order],
        row_offsets=row_offsets,
        **facts,
    )


def _split_into_chunks(sources: np.ndarray, lengths: np.ndarray, chunk_length: int):
    """Cut each sequence into consecutive chunks of at most `chunk_length` tokens (every token kept)."""
    chunks_per_source = -(-lengths // chunk_length)
    chunk_source = np.repeat(sources, chunks_per_source)
    first_chunk = _exclusive_cumsum(chunks_per_source)
    chunk_rank = np.arange(len(chunk_source)) - np.repeat(first_chunk, chunks_per_source)
    chunk_start = chunk_rank * chunk_length
    chunk_lengths = np.minimum(np.repeat(lengths, chunks_per_source) - chunk_start, chunk_length)
    return chunk_source, chunk_start, chunk_lengths


def _plan_wrapped(sources: np.ndarray, lengths: np.ndarray, seq_length: int) -> dict:
    """Cut the concatenation of all sequences every `seq_length` tokens.

    A sequence spanning rows `first_row..last_row` of the token stream becomes one segment per row.
    """
    sequence_starts = _exclusive_cumsum(lengths)
    sequence_ends = sequence_starts + lengths
    first_row = sequence_starts // seq_length
    segments_per_sequence = (sequence_ends - 1) // seq_length - first_row + 1
    segment_sequence = np.repeat(np.arange(len(lengths)), segments_per_sequence)
    first_segment = _exclusive_cumsum(segments_per_sequence)
    segment_row = first_row[segment_sequence] + np.arange(len(segment_sequence)) - first_segment[segment_sequence]
    starts = np.maximum(sequence_starts[segment_sequence], segment_row * seq_length)
    ends = np.minimum(sequence_ends[segment_sequence], (segment_row + 1) * seq_length)
    num_rows = -(-int(lengths.sum()) // seq_length)
    return dict(
        segment_source=sources[segment_sequence],
        segment_start=starts - sequence_starts[segment_sequence],
        segment_length=ends - starts,
        row_offsets=_exclusive_cumsum(np.bincount(segment_row, minlength=num_rows), include_total=True),
    )


def best_fit_decreasing(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-Fit-Decreasing bin packing of integer `sizes` (each in 1..capacity) over all items at once.

    Returns `(item_order, bin_offsets)`: the items of bin `b` are `item_order[bin_offsets[b]:bin_offsets[b+1]]`
    in placement order; bins are numbered in the order they were opened.

    Why it is fast: bins are only tracked by their free space (an integer below `capacity`), and items
    of equal size are placed together. Every bin with the smallest free space `s >= size` would receive
    items one after the other until its space drops below `size` (it stays the best fit), so a whole
    group of `k` equal items is placed with a few array operations per distinct free-space value
    instead of one tree search per item. The result is exactly BFD (ties between bins with equal
    free space are broken arbitrarily).
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    num_items = len(sizes)
    if num_items == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    if sizes.min() < 1 or sizes.max() > capacity:
        raise ValueError(f"item sizes must lie in 1..{capacity}.")

    order = np.argsort(-sizes, kind="stable")
    sorted_sizes = sizes[order]
    group_starts = np.flatnonzero(np.diff(sorted_sizes, prepend=0))
    group_sizes = sorted_sizes[group_starts].tolist()
    group_counts = np.diff(group_starts, append=num_items).tolist()

    bins = _FreeSpaceIndex(capacity)
    bin_of_sorted_item = np.empty(num_items, dtype=np.int64)
    placed_so_far = 0
    for size, count in zip(group_sizes, group_counts):
        while count:
            space, bin_ids = bins.take_best_fit(size, count)
            per_bin = space // size
            placed = min(count, len(bin_ids) * per_bin)
            bin_of_sorted_item[placed_so_far : placed_so_far + placed] = np.repeat(bin_ids, per_bin)[:placed]
            full_bins = placed // per_bin
            bins.put(space - per_bin * size, bin_ids[:full_bins])
            if full_bins < len(bin_ids):  # the last bin got fewer items: this group is done
                bins.put(space - (placed - full_bins * per_bin) * size, bin_ids[full_bins:])
            placed_so_far += placed
            count -= placed

    by_bin = np.argsort(bin_of_sorted_item, kind="stable")  # keeps placement order inside a bin
    bin_offsets = _exclusive_cumsum(np.bincount(bin_of_sorted_item, minlength=bins.num_bins), include_total=True)
    return order[by_bin], bin_offsets


class _FreeSpaceIndex:
    """Open bins grouped by free space, with a sorted list of the free-space values in use."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.num_bins = 0
        self._bins_by_space: dict[int, list[int]] = {}
        self._spaces_in_use: list[int] = []

    def take_best_fit(self, size: int, count: int) -> tuple[int, np.ndarray]:
        """Remove and return (space, bin ids) of the bins with the least free space >= size.

        Takes no more bins than `count` items of `size` need; opens new bins when none fits.
        """
        position = bisect.bisect_left(self._spaces_in_use, size)
        if position == len(self._spaces_in_use):
            needed = -(-count // (self.capacity // size))
            new_ids = np.arange(self.num_bins, self.num_bins + needed, dtype=np.int64)
            self.num_bins += needed
            return self.capacity, new_ids
        space = self._spaces_in_use[position]
        same_space = self._bins_by_space[space]
        needed = min(len(same_space), -(-count // (space // size)))
        taken = same_space[len(same_space) - needed :]
        del same_space[len(same_space) - needed :]
        if not same_space:
            del self._spaces_in_use[position]
        return space, np.array(taken, dtype=np.int64)

    def put(self, space: int, bin_ids: np.ndarray) -> None:
        if space == 0 or len(bin_ids) == 0:  # full bins are never looked at again
            return
        same_space = self._bins_by_space.setdefault(space, [])
        if not same_space:
            bisect.insort(self._spaces_in_use, space)
        same_space.extend(bin_ids.tolist())


# Work allowed for refilling loose bins, in knapsack steps of ~64 bits of bitset each (about 1 s).
REFILL_WORK_BUDGET = 3_000_000


def refill_loose_bins(
    sizes: np.ndarray,
    item_order: np.ndarray,
    bin_offsets: np.ndarray,
    capacity: int,
    max_bins: int = 2000,
    work_budget: int = REFILL_WORK_BUDGET,
) -> tuple[np.ndarray, np.ndarray]:
    """Repack the items of the bins BFD left with free space, filling each new bin as exactly as possible.

    Why: BFD leaves gaps smaller than the smallest remaining item. With medium-sized items and few small
    ones (typical SFT data such as gsm8k at 1024 tokens) that wastes 1-2% of the rows; repacking the
    loose bins as "largest item + the subset of the others that best fills the rest" (a small bitset
    knapsack per bin) brings the row count to the lower bound or next to it.

    Only runs when BFD is more than 0.1% of rows above the lower bound ceil(total / capacity), on at
    most `max_bins` loosest bins, within a fixed amount of work (items left when it runs out are packed
    by BFD again), and the result is only used when it has fewer rows. Deterministic. Same output
    layout as `best_fit_decreasing`.
    """
    num_bins = len(bin_offsets) - 1
    lower_bound = -(-int(sizes.sum()) // capacity)
    if num_bins - lower_bound <= lower_bound // 1000:
        return item_order, bin_offsets

    items_per_bin = np.diff(bin_offsets)
    slack = capacity - np.add.reduceat(sizes[item_order], bin_offsets[:-1])
    loose = np.flatnonzero(slack > 0)
    loose = np.sort(loose[np.argsort(-slack[loose], kind="stable")[:max_bins]])
    is_loose = np.zeros(num_bins, dtype=bool)
    is_loose[loose] = True
    in_loose_bin = np.repeat(is_loose, items_per_bin)

    refilled = _fill_bins_by_best_subset(item_order[in_loose_bin], sizes, capacity, work_budget)
    if len(refilled) >= len(loose):
        return item_order, bin_offsets
    new_order = np.concatenate([item_order[~in_loose_bin], *refilled])
    new_counts = np.concatenate([items_per_bin[~is_loose], [len(b) for b in refilled]])
    return new_order, _exclusive_cumsum(new_counts, include_total=True)


def _fill_bins_by_best_subset(items: np.ndarray, sizes: np.ndarray, capacity: int, work_budget: int) -> list:
    """Open bins one at a time: the largest remaining item plus the best-filling subset of the others.

    Returns the bins as arrays of item ids. Items left when `work_budget` runs out are packed by BFD.
    """
    items_by_size: dict[int, list[int]] = {}
    for item, size in zip(items.tolist(), sizes[items].tolist()):
        items_by_size.setdefault(size, []).append(item)
    bins = []
    while items_by_size and work_budget > 0:
        largest = max(items_by_size)
        contents = [_take_item(items_by_size, largest)]
        counts = {size: len(same) for size, same in items_by_size.items()}
        subset, work = _best_subset(counts, capacity - largest)
        contents += [_take_item(items_by_size, size) for size in subset]
        bins.append(np.array(contents, dtype=np.int64))
        work_budget -= work
    if items_by_size:
        rest = np.array([item for same in items_by_size.values() for item in same], dtype=np.int64)
        order, offsets = best_fit_decreasing(sizes[rest], capacity)
        bins += [rest[order[a:b]] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    return bins


def _take_item(items_by_size: dict[int, list[int]], size: int) -> int:
    same_size = items_by_size[size]
    item = same_size.pop()
    if not same_size:
        del items_by_size[size]
    return item


def _best_subset(counts: dict[int, int], room: int) -> tuple[list[int], int]:
    """Sizes (with repeats, largest first) of a sub-multiset of `counts` with the largest sum <= room.

    Bounded knapsack on a bitset (bit t of `reachable` set = sum t is reachable), with each size's
    copies split in powers of two so a size costs O(log count) shifts; larger sizes are tried first
    and the search stops as soon as `room` is hit exactly, which keeps small items for later bins.
    Also returns the work done (steps times 64-bit words of bitset).
    """
    within_room = (1 << (room + 1)) - 1
    reachable = 1
    steps = []  # (size, copies, reachable before adding them)
    for size in sorted((s for s in counts if s <= room), reverse=True):
        copies_left = min(counts[size], room // size)
        batch = 1
        while copies_left:
            copies = min(batch, copies_left)
            steps.append((size, copies, reachable))
            reachable |= (reachable << (copies * size)) & within_room
            copies_left -= copies
            batch *= 2
        if reachable >> room & 1:
            break
    target = reachable.bit_length() - 1
    chosen = []
    for size, copies, before in reversed(steps):
        if not before >> target & 1:  # target needs these copies
            chosen += [size] * copies
            target -= copies * size
    return sorted(chosen, reverse=True), len(steps) * (1 + room // 64)


# --------------------------------------------------------------------------------------------------
# Applying a plan to a datasets.Dataset
# --------------------------------------------------------------------------------------------------


def pack_dataset(dataset, seq_length: int, strategy: str = "bfd", map_kwargs: dict | None = None,
                 buffer_rows: int | None = None):
    """Pack a `datasets.Dataset` (or each split of a `DatasetDict`) into rows of at most `seq_length` tokens.

    A `datasets.IterableDataset` gives an IterableDataset: each buffer of `buffer_rows` sequences (default
    `streaming.STREAM_BUFFER_ROWS`) is packed by this same function (data/streaming.py says why bounded).

    Every list column is packed with the same layout; other columns cannot be packed and are dropped
    (logged). Adds `seq_lengths` (segment lengths of the row) and `position_ids` (restarting at 0 at
    every segment). `map_kwargs` is accepted for signature compatibility with TRL; packing does not
    go through `Dataset.map`, so it is not used.
    """
    _check_strategy(strategy)
    _check_seq_length(seq_length)
    if map_kwargs:
        logger.info("pack_dataset does not use Dataset.map; ignoring map_kwargs=%s.", map_kwargs)
    if isinstance(dataset, datasets.DatasetDict):
        return datasets.DatasetDict(
            {name: pack_dataset(split, seq_length, strategy) for name, split in dataset.items()}
        )
    if isinstance(dataset, datasets.IterableDatasetDict):
        return datasets.IterableDatasetDict(
            {name: pack_dataset(split, seq_length, strategy, buffer_rows=buffer_rows)
             for name, split in dataset.items()}
        )
    if isinstance(dataset, datasets.IterableDataset):
        return pack_stream(dataset, seq_length, strategy, buffer_rows)
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"pack_dataset needs a datasets.Dataset or DatasetDict, got {type(dataset).__name__}.")
    if len(dataset) == 0:
        raise ValueError("Cannot pack an empty dataset (it has no rows).")

    table = dataset.data.table
    row_map = _row_map(dataset)
    packed_names = _packable_columns(table)
    table = _nulls_as_empty_lists(table, packed_names)
    row_lengths = _common_row_lengths(table, packed_names)
    lengths = row_lengths if row_map is None else row_lengths[row_map]

    plan = plan_packing(lengths, seq_length, strategy)
    _log_plan(plan)
    gather = _Gather.from_plan(plan, row_lengths, row_map)
    row_token_offsets = _exclusive_cumsum(plan.row_lengths, include_total=True)
    columns = {name: _pack_column(table.column(name), gather, row_token_offsets) for name in packed_names}
    columns["seq_lengths"] = _list_array(plan.row_offsets, plan.segment_length.astype(np.int32))
    columns["position_ids"] = _list_array(row_token_offsets, _segment_positions(plan.segment_length, seq_length))
    return _to_dataset(pa.table(columns), dataset, seq_length, strategy)


def pack_stream(stream, seq_length: int, strategy: str = "bfd", buffer_rows: int | None = None):
    """`pack_dataset` of each buffer of `buffer_rows` sequences (default `streaming.STREAM_BUFFER_ROWS`), as a stream: the
    packing plan of a buffer is `plan_packing`'s over that buffer (see the module docstring for why bounded)."""
    buffer_rows = buffer_rows or streaming.STREAM_BUFFER_ROWS
    features = stream.features

    def pack_buffer(batch: dict) -> dict:  # not quiet: each buffer's truncations (strategy "bfd") are logged
        buffer = streaming.buffer_dataset(batch, features)
        return pack_dataset(buffer, seq_length, strategy).to_dict() if len(buffer) else {}

    columns = stream.column_names
    if columns is None:
        first = next(iter(stream.take(1)), None)
        columns = list(first) if first is not None else []
    return stream.map(pack_buffer, batched=True, batch_size=buffer_rows, remove_columns=columns)


def _check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"Unknown packing strategy {strategy!r}; accepted strategies are {', '.join(STRATEGIES)}.")


def _check_seq_length(seq_length) -> None:
    if isinstance(seq_length, bool) or not isinstance(seq_length, (int, np.integer)) or seq_length <= 0:
        raise ValueError(f"seq_length must be a positive integer, got {seq_length!r}.")


def _row_map(dataset) -> np.ndarray | None:
    """Rows of the underlying Arrow table that the dataset shows (after select/shuffle), or None.

    Resolving the indices mapping ourselves avoids materialising a shuffled copy of the data before
    packing: the gather below reads the selected rows straight from the original buffers.
    """
    indices = getattr(dataset, "_indices", None)
    if indices is None:
        return None
    return indices.column(0).to_numpy().astype(np.int64, copy=False)


def _is_list(arrow_type: pa.DataType) -> bool:
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


def _packable_columns(table: pa.Table) -> list[str]:
    """Names of the list columns to pack; logs every column that is dropped instead."""
    packed, dropped = [], []
    for field in table.schema:
        if field.name in LAYOUT_COLUMNS:
            logger.info("pack_dataset: recomputing %r; the input column is not packed.", field.name)
        elif _is_list(field.type):
            packed.append(field.name)
        else:
            dropped.append(field.name)
    if not packed:
        raise ValueError(
            f"pack_dataset needs at least one list column (such as input_ids); columns are {table.column_names}."
        )
    if dropped:
        logger.warning("pack_dataset: dropping columns that are not lists and cannot be packed: %s.", dropped)
    return packed


def _nulls_as_empty_lists(table: pa.Table, names: list[str]) -> pa.Table:
    """Null rows become empty lists (then dropped as empty sequences).

    Arrow lets a null list row span values, so its offsets cannot be trusted to line up with the rows.
    """
    for name in names:
        column = table.column(name)
        if column.null_count:
            filled = pc.fill_null(column, pa.scalar([], type=column.type))
            table = table.set_column(table.column_names.index(name), name, filled)
    return table


def _common_row_lengths(table: pa.Table, names: list[str]) -> np.ndarray:
    """Per-row list length, which every packed column must share (null rows count as empty)."""
    reference = "input_ids" if "input_ids" in names else names[0]

    def lengths_of(name: str) -> np.ndarray:
        return pc.list_value_length(table.column(name)).fill_null(0).to_numpy().astype(np.int64, copy=False)

    lengths = lengths_of(reference)
    for name in names:
        if name == reference:
            continue
        mismatched = np.flatnonzero(lengths_of(name) != lengths)
        if len(mismatched):
            row = int(mismatched[0])
            raise ValueError(
                f"Cannot pack column {name!r}: its lists differ in length from {reference!r} "
                f"(first at table row {row}); every list column is packed with the same layout, so remove "
                "columns that do not hold one value per token before packing."
            )
    return lengths


def _log_plan(plan: PackingPlan) -> None:
    if plan.num_truncated:
        logger.warning(
            "pack_dataset (strategy='bfd'): truncated %d sequences longer than %d tokens to their first %d "
            "tokens, dropping %d tokens; use strategy='bfd_split' to keep them.",
            plan.num_truncated,
            plan.seq_length,
            plan.seq_length,
            plan.tokens_dropped,
        )
    if plan.num_empty:
        logger.info("pack_dataset: dropped %d empty sequences.", plan.num_empty)
    logger.info("pack_dataset: %s.", plan.summary())


@dataclass(frozen=True)
class _Gather:
    """How to move token values from the table into packed order, as a `take` of whole 'pieces'.

    A plan's segments are always whole pieces of the table rows: `bfd` and `bfd_split` cut sequences
    every `seq_length` tokens and keep (some of) the chunks, so their pieces are those chunks; `wrapped`
    moves whole sequences back to back, so its pieces are the rows. The pieces of table row `r` are
    `first_piece[r]:first_piece[r + 1]`, bounded by `piece_bounds` (positions in the concatenated token
    stream of the table). The packed values of any list column are its pieces taken in `piece_order`;
    `piece_order is None` means the values are used unchanged.
    """

    first_piece: np.ndarray  # per table row, plus the total number of pieces
    piece_bounds: np.ndarray  # token position where each piece starts, plus the total number of tokens
    piece_order: np.ndarray | None

    @classmethod
    def from_plan(cls, plan: PackingPlan, row_lengths: np.ndarray, row_map: np.ndarray | None) -> _Gather:
        row_starts = _exclusive_cumsum(row_lengths, include_total=True)
        table_rows = plan.segment_source if row_map is None else row_map[plan.segment_source]
        if plan.strategy == "wrapped":
            # Segments tile the non-empty sequences in dataset order: move whole rows, in that order.
            whole_rows = np.arange(len(row_lengths) + 1)
            order = None if row_map is None else table_rows[plan.segment_start == 0]
            return cls(whole_rows, row_starts, order)

        pieces_per_row = np.maximum(1, -(-row_lengths // plan.seq_length))
        if pieces_per_row.max(initial=1) == 1:  # no row is cut: pieces are rows
            return cls(np.arange(len(row_lengths) + 1), row_starts, table_rows)
        first_piece = _exclusive_cumsum(pieces_per_row, include_total=True)
        piece_row = np.repeat(np.arange(len(row_lengths)), pieces_per_row)
        piece_rank = np.arange(len(piece_row)) - first_piece[piece_row]
        piece_bounds = np.append(row_starts[piece_row] + piece_rank * plan.seq_length, row_starts[-1])
        return cls(first_piece, piece_bounds, first_piece[table_rows] + plan.segment_start // plan.seq_length)


def _pack_column(column: pa.ChunkedArray, gather: _Gather, row_token_offsets: np.ndarray) -> pa.Array:
    return _list_array(row_token_offsets, _gathered_values(column, gather), large=pa.types.is_large_list(column.type))


def _gathered_values(column: pa.ChunkedArray, gather: _Gather) -> pa.Array:
    """The column's values rearranged into packed order."""
    value_type = column.type.value_type
    if gather.piece_order is None:
        return _single_chunk(column).flatten()
    if len(gather.piece_order) == 0:
        return pa.array([], type=value_type)
    if _is_fixed_width(value_type) and all(chunk.values.null_count == 0 for chunk in column.chunks):
        return _gather_fixed_width(column, gather)
    return _gather_any_type(column, gather)


def _single_chunk(column: pa.ChunkedArray) -> pa.Array:
    """The column as one array, copying only when it has several chunks."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _is_fixed_width(value_type: pa.DataType) -> bool:
    return (
        pa.types.is_integer(value_type) or pa.types.is_floating(value_type) or pa.types.is_temporal(value_type)
    ) and value_type.bit_width % 8 == 0


def _gather_fixed_width(column: pa.ChunkedArray, gather: _Gather) -> pa.Array:
    """Gather numeric values by viewing each piece as one opaque binary value.

    Arrow's `take` on a large_binary array copies each value with one memcpy, which is an order of
    magnitude faster than taking list elements and needs no per-token index array.
    """
    item_size = column.type.value_type.bit_width // 8
    pieces = list(_binary_pieces(column, gather, item_size))
    # One array: Arrow's take on a chunked binary array is several times slower than concatenating first.
    pieces = pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)
    taken = pieces.take(pa.array(gather.piece_order))
    byte_offsets = np.frombuffer(taken.buffers()[1], dtype=np.int64)[taken.offset : taken.offset + len(taken) + 1]
    first_byte, last_byte = int(byte_offsets[0]), int(byte_offsets[-1])
    return pa.Array.from_buffers(
        column.type.value_type,
        (last_byte - first_byte) // item_size,
        [None, taken.buffers()[2]],
        offset=first_byte // item_size,
    )


def _binary_pieces(column: pa.ChunkedArray, gather: _Gather, item_size: int):
    """One large_binary array per chunk whose values are the pieces lying in that chunk, zero copy."""
    first_row = 0
    for chunk in column.chunks:
        end_row = first_row + len(chunk)
        first_piece, end_piece = int(gather.first_piece[first_row]), int(gather.first_piece[end_row])
        # Token position of the chunk's first token inside the chunk's values buffer.
        buffer_start = chunk.offsets[0].as_py() + chunk.values.offset
        token_offsets = gather.piece_bounds[first_piece : end_piece + 1] - gather.piece_bounds[first_piece]
        data = chunk.values.buffers()[1] or pa.py_buffer(b"")
        yield pa.Array.from_buffers(
            pa.large_binary(),
            end_piece - first_piece,
            [None, pa.py_buffer((token_offsets + buffer_start) * item_size), data],
        )
        first_row = end_row


def _gather_any_type(column: pa.ChunkedArray, gather: _Gather) -> pa.Array:
    """Fallback for values Arrow cannot view as bytes (booleans, nested lists, values with nulls)."""
    flat = _single_chunk(column).flatten()
    pieces = pa.LargeListArray.from_arrays(pa.array(gather.piece_bounds, type=pa.int64()), flat)
    return pieces.take(pa.array(gather.piece_order)).flatten()


def _segment_positions(segment_lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """0, 1, ..., n-1 for each segment of length n, concatenated (int32)."""
    try:
        return _ramp_prefixes(segment_lengths, seq_length)
    except (AttributeError, NotImplementedError, pa.ArrowNotImplementedError):  # pyarrow without binary_view
        return _restarting_count(segment_lengths)


def _ramp_prefixes(segment_lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """Positions as prefixes of one `arange(seq_length)`, copied by Arrow in a single pass.

    Each segment is a binary_view value pointing at the first `4 * n` bytes of the int32 ramp; casting
    to large_binary concatenates them. Views of at most 12 bytes (n <= 3) store their bytes inline.
    """
    total = int(segment_lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int32)
    ramp = np.arange(seq_length, dtype=np.int32)
    views = np.zeros((len(segment_lengths), 4), dtype=np.int32)  # [size, prefix, buffer index, offset]
    views[:, 0] = segment_lengths * 4
    inline = segment_lengths <= 3
    views[inline, 2] = segment_lengths[inline] >= 2  # inline bytes 4..11 hold ramp[1], ramp[2]
    views[inline, 3] = (segment_lengths[inline] >= 3) * 2
    as_views = pa.Array.from_buffers(
        pa.binary_view(), len(segment_lengths), [None, pa.py_buffer(views), pa.py_buffer(ramp)]
    )
    concatenated = as_views.cast(pa.large_binary())
    start = np.frombuffer(concatenated.buffers()[1], dtype=np.int64)[concatenated.offset]
    return np.frombuffer(concatenated.buffers()[2], dtype=np.int32, offset=int(start), count=total)


def _restarting_count(segment_lengths: np.ndarray) -> np.ndarray:
    """Same result as `_ramp_prefixes`: a cumulative sum of ones that drops back to 0 at each segment start."""
    steps = np.ones(int(segment_lengths.sum()), dtype=np.int32)
    if len(steps) == 0:
        return steps
    segment_starts = _exclusive_cumsum(segment_lengths)
    steps[segment_starts[1:]] = 1 - segment_lengths[:-1]
    steps[0] = 0
    return np.cumsum(steps, dtype=np.int32, out=steps)


def _list_array(offsets: np.ndarray, values, large: bool = False) -> pa.Array:
    """A `list<item>` array from offsets and flat values (large_list when asked or when int32 overflows)."""
    values = values if isinstance(values, pa.Array) else pa.array(values)
    if large or offsets[-1] > _INT32_MAX:
        return pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), values)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values)


def _to_dataset(table: pa.Table, source, seq_length: int, strategy: str):
    """Wrap the packed table in a Dataset that keeps the source's info and output format."""
    info = source.info.copy()
    info.features = None  # re-inferred from the packed table
    fingerprint = Hasher.hash(("leantune.pack_dataset/1", getattr(source, "_fingerprint", None), seq_length, strategy))
    packed = datasets.Dataset(
        datasets.table.InMemoryTable(table), info=info, split=source.split, fingerprint=fingerprint
    )
    fmt = source.format
    columns = fmt["columns"]
    if columns is not None:
        columns = [name for name in columns if name in table.column_names]
        columns += [name for name in LAYOUT_COLUMNS if name not in columns]
    return packed.with_format(
        fmt["type"], columns=columns, output_all_columns=fmt["output_all_columns"], **fmt["format_kwargs"]
    )


def _exclusive_cumsum(values: np.ndarray, include_total: bool = False) -> np.ndarray:
    """[0, v0, v0+v1, ...]: start offsets of consecutive runs of the given lengths (int64)."""
    out = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=out[1:])
    return out if include_total else out[:-1]
