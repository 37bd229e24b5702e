"""Batch layouts for causal-LM training: padded, padding-free (one flat row) and packed rows.

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
                "max_length_k", "shared_prompt_of", "shared_prompt_ring")  # the last two: shared-prompt rows
# (trainers/online/shared_prompt.py; split over a context-parallel group: shared_prompt_ring.py)


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
