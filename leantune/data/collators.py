"""Batch layouts for causal-LM training: padded, padding-free (one flat row), packed rows, and the online methods'
shared-prompt rows (`SharedPromptCollator`).

Every layout carries the same loss tokens: a token is a target when its `labels` entry (prepared SFT data) and its
loss masks allow it and it is not the first token of its sequence, so that no prediction crosses from one sequence
into the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

IGNORE_INDEX = -100
# The collated entries a causal LM's forward takes (padded or segmented layouts).
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                "max_length_k", "shared_prompt_of", "prefix_blocks", "shared_prompt_ring")  # the last three: shared-
# prompt rows (`SharedPromptCollator`; split over a context-parallel group: trainers/parts/shared_prompt_ring.py)
SHARED_PROMPT_OF = "shared_prompt_of"  # per segment of a shared-prompt row: the segment holding its prompt, or -1
PREFIX_BLOCKS = "prefix_blocks"  # a shared-prompt row's attention layout (`prefix_blocks`), read by segment attention


def round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple


def segment_positions(seq_lengths) -> np.ndarray:
    """Position ids restarting at 0 for every segment."""
    seq_lengths = np.asarray(seq_lengths, dtype=np.int64)
    starts = np.repeat(np.cumsum(seq_lengths) - seq_lengths, seq_lengths)
    return np.arange(int(seq_lengths.sum()), dtype=np.int64) - starts


@dataclass
class CausalLMCollator:
    """Collate tokenised examples (or packed rows carrying `seq_lengths`).

    padded: input_ids, attention_mask, labels of shape [batch, longest].
    padding_free: all examples of the batch in one row, with restarting position_ids and no attention mask.
    packed rows (examples with `seq_lengths`): one row each, restarting position_ids, no attention mask; with
    padding_free, the packed rows of the batch are laid end to end in one row (their segments kept, no padding
    between rows), so packing + padding_free is packing with padding-free batches.
    """

    pad_token_id: int
    loss_mask_columns: tuple[str, ...] = ()
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    return_tensors: str = field(default="pt")

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        packed = "seq_lengths" in examples[0]
        rows = [self._row(ex, ex["seq_lengths"] if packed else [len(ex["input_ids"])]) for ex in examples]
        if self.padding_free:
            # Segments keep their restarting positions, so the row's sequences are exactly the examples' (or the
            # packed rows') sequences, in order.
            flat = tuple(np.concatenate(parts) for parts in zip(*rows))
            return self._stack_segmented([flat])
        return self._stack_segmented(rows) if packed else self._stack_padded(rows)

    def _row(self, example: dict, seq_lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids = np.asarray(example["input_ids"], dtype=np.int64)
        positions = segment_positions(seq_lengths)
        if len(positions) != len(ids):
            raise ValueError(f"seq_lengths sum to {len(positions)} but the row has {len(ids)} tokens.")
        target = positions > 0
        for name in self.loss_mask_columns:
            target &= np.asarray(example[name], dtype=bool)
        given = example.get("labels")  # prepared SFT data: the targets themselves, -100 where there is none
        if given is not None:
            given = np.asarray(given, dtype=np.int64)
            target &= given != IGNORE_INDEX
        labels = np.where(target, ids if given is None else given, IGNORE_INDEX)
        return ids, labels, positions

    def _stack_padded(self, rows) -> dict[str, torch.Tensor]:
        width = round_up(max(len(ids) for ids, _, _ in rows), self.pad_to_multiple_of)
        input_ids = np.full((len(rows), width), self.pad_token_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        attention_mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, (ids, lab, _) in enumerate(rows):
            input_ids[i, : len(ids)], labels[i, : len(ids)], attention_mask[i, : len(ids)] = ids, lab, 1
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "labels": torch.from_numpy(labels),
            "num_real_tokens": torch.tensor(int(attention_mask.sum())),
        }

    def _stack_segmented(self, rows) -> dict[str, torch.Tensor]:
        """Rows of restarting segments; padding forms its own segment so it never joins a real sequence."""
        width = round_up(max(len(ids) for ids, _, _ in rows), self.pad_to_multiple_of)
        input_ids = np.full((len(rows), width), self.pad_token_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        position_ids = np.zeros((len(rows), width), dtype=np.int64)
        real = 0
        for i, (ids, lab, pos) in enumerate(rows):
            n = len(ids)
            input_ids[i, :n], labels[i, :n], position_ids[i, :n] = ids, lab, pos
            position_ids[i, n:] = np.arange(width - n)
            real += n
        starts = np.flatnonzero(position_ids.reshape(-1) == 0)
        cu_seq_lens = torch.from_numpy(np.append(starts, position_ids.size).astype(np.int32))
        max_length = int(np.diff(cu_seq_lens.numpy()).max())
        return {
            "input_ids": torch.from_numpy(input_ids),
            "position_ids": torch.from_numpy(position_ids),
            "labels": torch.from_numpy(labels),
            # Sequence offsets over the flattened rows: FlashAttention varlen and leantune's segment attention.
            "cu_seq_lens_q": cu_seq_lens,
            "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": max_length,
            "max_length_k": max_length,
            "num_real_tokens": torch.tensor(real),
        }


@dataclass
class SharedPromptCollator:
    """Shared-prompt rows (`shared_prompt=True`): each group's prompt passes through a forward once, not G times.

    A micro-batch of prompt + completion examples (`input_ids`, `completion_mask`, and `prompt_length`: where the
    prompt ends) becomes one row laid out as [prompt, completion_1, ..., completion_G] per group (consecutive examples
    with the same prompt tokens form a group; a group split between micro-batches or processes shares within each
    part). Each completion ("branch") restarts its positions at len(prompt), so its rotary positions are those of the
    unshared row, and segment attention (models/segment_attention.py, `shared_prompt_of`) lets its queries see the
    prompt's keys and its own causal prefix: every hidden state of a completion token equals the unshared one. The
    completion's first token is predicted from the prompt's last position, one hidden state that all G branches
    gather (its gradient summed over them, as the prompt's K/V gradients are). Padding (`pad_to_multiple_of`) is a
    segment of its own.

    So the targets cannot be read from `labels` (one position predicts G tokens): the batch carries them as flat
    `target_index` (the position whose hidden state predicts the token), `target_tokens` and `target_sequence` (the
    example each target belongs to), in the unshared flat order (example after example, token after token), so
    per-token log-probs, sampling log-probs and the losses line up with the unshared path one to one.

    Why this mechanism: the one-row layout reuses the padding-free machinery (segment offsets, restarting positions,
    the chunked head's flat target index) and needs nothing that only runs on some devices; the prompt's K/V are
    computed once with their gradients, so the memory of the prompt's activations is paid once per group, and the
    attention work per branch is L_b x (L_p + L_b) as in the unshared row. Whether a run uses it:
    trainers/online/shared_prompt.py.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        ids, positions, segments, prompt_of = [], [], [], []
        target_index, target_tokens, target_sequence = [], [], []
        last_prompt, prompt_segment, prompt_end = None, -1, 0
        for n, example in enumerate(examples):
            tokens, length = list(example["input_ids"]), example["prompt_length"]
            prompt, completion = tokens[:length], tokens[length:]
            mask = list(example["completion_mask"])[length:]
            if prompt != last_prompt:  # a new group: its prompt is a segment of its own
                last_prompt, prompt_segment = prompt, len(segments)
                segments.append(len(prompt))
                prompt_of.append(-1)
                ids += prompt
                positions += range(len(prompt))
                prompt_end = len(ids)
            if not completion:
                continue  # nothing to score; the example still counts as a sequence
            start = len(ids)
            segments.append(len(completion))
            prompt_of.append(prompt_segment)
            ids += completion
            positions += range(length, length + len(completion))
            for j, (token, kept) in enumerate(zip(completion, mask)):
                if kept:
                    target_index.append(prompt_end - 1 if j == 0 else start + j - 1)
                    target_tokens.append(token)
                    target_sequence.append(n)
        real = len(ids)
        padding = round_up(real, self.pad_to_multiple_of) - real
        if padding:
            segments.append(padding)
            prompt_of.append(-1)
            ids += [self.pad_token_id] * padding
            positions += range(padding)
        cu_seq_lens = torch.from_numpy(np.concatenate(([0], np.cumsum(segments))).astype(np.int32))
        return {
            "input_ids": torch.tensor([ids], dtype=torch.long),
            "position_ids": torch.tensor([positions], dtype=torch.long),
            "cu_seq_lens_q": cu_seq_lens,
            "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": max(segments),
            "max_length_k": max(segments),
            SHARED_PROMPT_OF: torch.tensor(prompt_of, dtype=torch.long),
            PREFIX_BLOCKS: prefix_blocks(segments, prompt_of),
            "target_index": torch.tensor(target_index, dtype=torch.long),
            "target_tokens": torch.tensor(target_tokens, dtype=torch.long),
            "target_sequence": torch.tensor(target_sequence, dtype=torch.long),
            "num_real_tokens": torch.tensor(real),
        }


# What a gathered key and value cost against the scores of one query row (their copies forward and backward):
# about 16 scores, fitted to the timings of `bench/shared_prompt.py --attention` at 64:256 x 2 and x 16, 1024:256 x 2
# and x 16, 256:64 x 8 (the fastest block length of 256, 128, 64, 32 chosen in each)
GATHER_COST = 16


def block_length(lengths: list[int], prompt_of: list[int], smallest: int = 16) -> int:
    """The block length with the least attention work, E x (P + Lq) x (Lq + GATHER_COST) (masked scores included):
    the longest completion, or a half, a quarter... of it where that pads less than it repeats prefixes (a short
    prompt before few long completions: its one block is mostly padding at the completions' length)."""
    branches = [length for length, prompt in zip(lengths, prompt_of) if prompt >= 0]
    longest = max(branches) if branches else max(lengths, default=0)
    candidates = [max(longest, 1)]
    while candidates[-1] // 2 >= smallest:
        candidates.append(-(-candidates[-1] // 2))

    def work(block: int) -> int:  # a segment's last block has the longest prefix: its prompt and its earlier blocks
        counts = [-(-length // block) for length in lengths]
        prefix = max(((lengths[prompt] if prompt >= 0 else 0) + (count - 1) * block
                      for count, prompt in zip(counts, prompt_of) if count), default=0)
        return sum(counts) * (prefix + block) * (block + GATHER_COST)

    return min(candidates, key=lambda block: (work(block), -block))


def prefix_blocks(lengths: list[int], prompt_of: list[int], block: int | None = None) -> dict[str, torch.Tensor]:
    """A shared-prompt row's attention layout (models/segment_attention.py says why this one): each segment
    (`lengths`, with its prompt's segment `prompt_of`, or -1) cut into E query blocks of length Lq (`block`, default
    `block_length`'s), a block's prefix its prompt's keys (a completion's) and its segment's earlier blocks, P the
    longest prefix. As row positions: `queries` [E x Lq] (past a block's end: 0, a padding query), `keys` [E x (P +
    Lq)] (its prefix's, then its own from P on; 0 where none); `mask` [E, 1, Lq, P + Lq] (every key of its prefix,
    its own causally, a padding query all its own so that no row is all masked); `output` [row length]: each row
    position's place among the E x Lq queries. Computed on the host in one pass over the blocks (numpy), each tensor
    made once, when the batch is collated, so the model's forward builds nothing and reads nothing back."""
    block = block or block_length(lengths, prompt_of)
    lengths, prompt_of = np.asarray(lengths, dtype=np.int64), np.asarray(prompt_of, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    counts = -(-lengths // block)
    segment = np.repeat(np.arange(len(lengths)), counts)  # per block: its segment, its offset in it, where it starts
    offset = (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)) * block
    start, own_length = starts[segment] + offset, np.minimum(block, lengths[segment] - offset)
    prompt = prompt_of[segment]
    prompt_length = np.where(prompt >= 0, lengths[prompt], 0)
    seen = prompt_length + offset  # the prefix: the prompt's keys, then the segment's up to the block
    prefix = int(seen.max(initial=0))
    query, key = np.arange(block), np.arange(prefix + block)
    own = key - prefix  # a key's place among the block's own keys (from P on)
    in_prefix, is_own = key < seen[:, None], (own >= 0) & (own < own_length[:, None])
    prefix_key = np.where(key < prompt_length[:, None], starts[prompt][:, None] + key,
                          starts[segment][:, None] + key - prompt_length[:, None])
    keys = np.where(in_prefix, prefix_key, np.where(is_own, start[:, None] + own, 0))
    real = query < own_length[:, None]
    queries = np.where(real, start[:, None] + query, 0)
    mask = np.empty((len(segment), 1, block, prefix + block), dtype=bool)  # written in two parts, each once
    mask[:, 0, :, :prefix] = in_prefix[:, None, :prefix]
    mask[:, 0, :, prefix:] = real[:, None, :] & (query <= query[:, None])  # a padding query: all its own
    output = np.empty(int(lengths.sum()), dtype=np.int64)
    output[queries[real]] = (np.arange(len(segment))[:, None] * block + query)[real]
    return {"queries": torch.from_numpy(queries.reshape(-1)), "keys": torch.from_numpy(keys.reshape(-1)),
            "mask": torch.from_numpy(mask), "output": torch.from_numpy(output)}


def layout_like(batch: dict, values: list[list[int]], fill: int = 0) -> torch.Tensor:
    """Per-token values of the batch's sequences (one list per example, in order) in the batch's own layout: padded
    rows (with an attention mask), or the examples laid end to end in one padding-free row."""
    shape = batch["input_ids"].shape
    out = torch.full(shape, fill, dtype=torch.long)
    if "attention_mask" in batch:
        for row, row_values in enumerate(values):
            out[row, : len(row_values)] = torch.as_tensor(row_values, dtype=torch.long)
        return out
    flat = [v for row_values in values for v in row_values]
    out.view(-1)[: len(flat)] = torch.as_tensor(flat, dtype=torch.long)
    return out


def prompt_completion_row(prompt, completion, completion_mask=None) -> dict:
    """One sequence for CausalLMCollator (with `loss_mask_columns=("completion_mask",)`): the prompt then the
    completion, whose tokens are the targets (those `completion_mask` keeps, when given)."""
    mask = [1] * len(completion) if completion_mask is None else list(completion_mask)
    return {"input_ids": list(prompt) + list(completion), "completion_mask": [0] * len(prompt) + mask}


def sequence_starts(batch: dict) -> torch.Tensor:
    """Flat start offset of every sequence of a collated batch, in order (segmented layouts include a trailing
    padding segment, which holds no targets)."""
    if "cu_seq_lens_q" in batch:
        return batch["cu_seq_lens_q"][:-1].long()
    rows, width = batch["input_ids"].shape
    return torch.arange(rows, device=batch["input_ids"].device) * width


def sequence_prompts(batch: dict) -> list[list[int]]:
    """The prompt of every sequence of a collated batch that has targets, in order: its tokens before its first
    target (any layout: padded rows, padding-free or packed rows). On-policy training regenerates from these."""
    ids, labels = batch["input_ids"].reshape(-1), batch["labels"].reshape(-1)
    starts = sequence_starts(batch).tolist()
    if "cu_seq_lens_q" in batch:
        ends = batch["cu_seq_lens_q"][1:].long().tolist()
    else:
        ends = (sequence_starts(batch) + batch["attention_mask"].sum(-1)).tolist()
    prompts = []
    for start, end in zip(starts, ends):
        first = (labels[start:end] != IGNORE_INDEX).nonzero()
        if len(first):
            prompts.append(ids[start:start + int(first[0])].tolist())
    return prompts
