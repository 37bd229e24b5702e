"""Tokenise a dataset into the sequence lengths a trainer would see, batched over all cores.

The lengths come from the trainers' own tokenisation code (`SFTTokenizer` for SFT data, `PreferenceTokenizer`
for preference pairs), so the chat template, special tokens and EOS are exactly the trainer's. Only lengths leave
the worker processes, never token ids.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field

import numpy as np

from ..data.chat_template import require_chat_template
from ..data.formats import SFTFormat, detect_sft_format
from ..data.preference_formats import (
    ACCEPTED_PREFERENCE_FORMATS,
    TOKENIZED_COLUMNS,
    PreferenceFormat,
    PreferenceTokenizer,
    detect_preference_format,
    is_empty_completion,
    is_preference_dataset,
)
from ..data.sft_tokenization import SFTTokenizer, is_empty_example
from ..data.truncation import sequence_lengths

# Below this many rows per process, starting worker processes costs more than it saves.
MIN_ROWS_PER_PROCESS = 10_000
MAP_BATCH_SIZE = 1000
PREFERENCE_PARTS = ("prompt", "chosen", "rejected", "prompt+chosen", "prompt+rejected")


@dataclass
class DatasetLengths:
    """Token counts of every example, as the trainer would tokenise them.

    `sequences` holds what the trainer truncates, pads and packs: for SFT one entry per non-empty example (empty
    examples are dropped by the trainer and only counted); for preference data two entries per pair, prompt +
    chosen and prompt + rejected (pair i at 2i and 2i + 1), since a preference batch holds both rows; pairs with
    an empty completion or identical chosen and rejected are dropped by the DPO trainer and only counted.
    """

    kind: str  # "sft" or "preference"
    data_format: str
    num_rows: int
    sequences: np.ndarray
    num_empty: int = 0  # SFT: empty examples; preference: pairs with an empty completion (both dropped, counted)
    num_identical: int = 0  # preference: pairs whose chosen and rejected are the same (dropped, counted)
    parts: dict[str, np.ndarray] = field(default_factory=dict)  # preference: PREFERENCE_PARTS
    # SFT prompt-completion data: each sequence's prompt tokens (not loss targets), for planning from lengths alone
    prompts: np.ndarray | None = None

    def row_lengths(self) -> dict[str, list[int]]:
        """Every kept row's lengths in data order (what `leantune plan --lengths` rebuilds rows from): SFT
        "sequences" (and "prompts"), preference "prompt", "chosen", "rejected"."""
        if self.kind == "preference":
            return {name: self.parts[name].tolist() for name in ("prompt", "chosen", "rejected")}
        rows = {"sequences": self.sequences.tolist()}
        if self.prompts is not None:
            rows["prompts"] = self.prompts.tolist()
        return rows

    @property
    def rows_per_item(self) -> int:
        """Rows one example puts in a batch: 1 for SFT, 2 (chosen and rejected) for a preference pair."""
        return 2 if self.kind == "preference" else 1

    @property
    def items(self) -> np.ndarray:
        """Lengths shaped [examples, rows_per_item]: the unit the trainer shuffles and batches."""
        return self.sequences.reshape(-1, self.rows_per_item)


def default_num_proc() -> int:
    """All cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def effective_num_proc(num_rows: int, num_proc: int | None) -> int | None:
    """Worker processes for `Dataset.map`: all cores by default, none for data too small to gain from them."""
    wanted = default_num_proc() if num_proc is None else num_proc
    wanted = min(wanted, num_rows // MIN_ROWS_PER_PROCESS)
    return wanted if wanted > 1 else None


def detect_kind(dataset, text_field: str = "text") -> tuple[str, str]:
    """("sft" | "preference", format name); an error naming the columns and every accepted format otherwise."""
    if is_preference_dataset(dataset.column_names):
        return "preference", detect_preference_format(dataset).value
    try:
        return "sft", detect_sft_format(dataset, text_field).value
    except ValueError as error:
        if "Could not recognise" not in str(error):
            raise
        raise ValueError(
            f"{error} Preference formats: {ACCEPTED_PREFERENCE_FORMATS}. Other column names can be mapped with "
            "--prompt_column, --completion_column, --messages_column, --chosen_column, --rejected_column "
            "(column_mapping= in Python)."
        ) from None


def tokenize_lengths(dataset, tokenizer, text_field: str = "text", eos_token: str | None = None,
                     num_proc: int | None = None) -> DatasetLengths:
    """Lengths of every example of `dataset`, tokenised as the trainer for its format would tokenise it."""
    if len(dataset) == 0:
        raise ValueError("The dataset is empty (0 rows): there is nothing to profile.")
    kind, data_format = detect_kind(dataset, text_field)
    eos_id = tokenizer.convert_tokens_to_ids(eos_token) if eos_token else tokenizer.eos_token_id
    num_proc = effective_num_proc(len(dataset), num_proc)
    if num_proc:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are the parallelism
    if kind == "sft":
        return _sft_lengths(dataset, tokenizer, SFTFormat(data_format), text_field, eos_id, num_proc)
    return _preference_lengths(dataset, tokenizer, PreferenceFormat(data_format), eos_id, num_proc)


def _require_chat_template(tokenizer) -> None:
    require_chat_template(tokenizer)


def _column(dataset, name: str) -> np.ndarray:
    return dataset.data.column(name).to_numpy()


def _map_lengths(dataset, counter, num_proc):
    """Run a length counter over the dataset in batches (and processes).

    An in-memory dataset has no cache to reuse, so it gets a fresh fingerprint instead of one hashed from the
    counter: hashing pickles the whole tokenizer, which costs more than tokenising a small dataset.
    """
    fingerprint = None if dataset.cache_files else uuid.uuid4().hex
    return dataset.map(counter, batched=True, batch_size=MAP_BATCH_SIZE, remove_columns=dataset.column_names,
                       num_proc=num_proc, desc="Tokenising", new_fingerprint=fingerprint)


def _sft_lengths(dataset, tokenizer, fmt: SFTFormat, text_field: str, eos_id, num_proc) -> DatasetLengths:
    if fmt is SFTFormat.TOKENIZED:
        lengths = sequence_lengths(dataset)
        non_empty = lengths > 0
        return DatasetLengths("sft", fmt.value, len(dataset), lengths[non_empty], int((~non_empty).sum()))
    if fmt in (SFTFormat.CONVERSATIONAL, SFTFormat.CONVERSATIONAL_PROMPT_COMPLETION):
        _require_chat_template(tokenizer)
    count = SFTLengthCounter(SFTTokenizer(tokenizer, fmt, text_field, False, eos_id), text_field)
    counted = _map_lengths(dataset, count, num_proc)
    lengths, empty = _column(counted, "num_tokens").astype(np.int64), _column(counted, "is_empty").astype(bool)
    prompts = _column(counted, "num_prompt_tokens").astype(np.int64)[~empty] if fmt in (
        SFTFormat.PROMPT_COMPLETION, SFTFormat.CONVERSATIONAL_PROMPT_COMPLETION) else None
    return DatasetLengths("sft", fmt.value, len(dataset), lengths[~empty], int(empty.sum()), prompts=prompts)


def _preference_lengths(dataset, tokenizer, fmt: PreferenceFormat, eos_id, num_proc) -> DatasetLengths:
    if fmt is PreferenceFormat.TOKENIZED:
        prompt, chosen, rejected = (sequence_lengths(dataset, name) for name in TOKENIZED_COLUMNS)
        same = zip(dataset["chosen_ids"], dataset["rejected_ids"])
        identical = np.fromiter((c == r for c, r in same), bool, len(dataset))
        empty = np.zeros(len(dataset), dtype=bool)
    else:
        if fmt.conversational:
            _require_chat_template(tokenizer)
        count = PreferenceLengthCounter(PreferenceTokenizer(tokenizer, fmt, eos_id))
        counted = _map_lengths(dataset, count, num_proc)
        prompt, chosen, rejected = (_column(counted, name).astype(np.int64) for name in ("prompt", "chosen", "rejected"))
        empty = _column(counted, "empty").astype(bool)
        identical = _column(counted, "identical").astype(bool) & ~empty
    # As the DPO trainer: pairs with an empty completion or no difference teach nothing; dropped and counted.
    kept = ~(empty | identical)
    prompt, chosen, rejected = prompt[kept], chosen[kept], rejected[kept]
    parts = {"prompt": prompt, "chosen": chosen, "rejected": rejected,
             "prompt+chosen": prompt + chosen, "prompt+rejected": prompt + rejected}
    sequences = np.stack([parts["prompt+chosen"], parts["prompt+rejected"]], axis=1).reshape(-1)
    return DatasetLengths("preference", fmt.value, len(dataset), sequences, int(empty.sum()), int(identical.sum()),
                          parts)


class SFTLengthCounter:
    """`Dataset.map` function: token count of each example (0 for empty ones, which are flagged)."""

    def __init__(self, encoder: SFTTokenizer, text_field: str):
        self.encoder = encoder
        self.text_field = text_field

    def __call__(self, batch: dict) -> dict:
        size = len(next(iter(batch.values())))
        empty = [is_empty_example({k: batch[k][i] for k in batch}, self.encoder.fmt, self.text_field)
                 for i in range(size)]
        kept = [i for i in range(size) if not empty[i]]
        num_tokens, num_prompt = [0] * size, [0] * size
        if kept:
            encoded = self.encoder({k: [batch[k][i] for i in kept] for k in batch})
            masks = encoded.get("completion_mask") or [None] * len(kept)
            for i, ids, mask in zip(kept, encoded["input_ids"], masks):
                num_tokens[i] = len(ids)
                num_prompt[i] = 0 if mask is None else len(mask) - sum(mask)
        return {"num_tokens": num_tokens, "is_empty": empty, "num_prompt_tokens": num_prompt}


class PreferenceLengthCounter:
    """`Dataset.map` function: prompt, chosen and rejected token counts of each pair, and its odd cases."""

    def __init__(self, encoder: PreferenceTokenizer):
        self.encoder = encoder

    def __call__(self, batch: dict) -> dict:
        rows = self.encoder.explicit_rows(batch)
        encoded = self.encoder.encode(rows)
        same_ids = [c == r for c, r in zip(encoded["chosen_ids"], encoded["rejected_ids"])]
        return {
            "prompt": [len(ids) for ids in encoded["prompt_ids"]],
            "chosen": [len(ids) for ids in encoded["chosen_ids"]],
            "rejected": [len(ids) for ids in encoded["rejected_ids"]],
            "identical": [row["chosen"] == row["rejected"] or same for row, same in zip(rows, same_ids)],
            "empty": [is_empty_completion(row["chosen"]) or is_empty_completion(row["rejected"]) for row in rows],
        }
