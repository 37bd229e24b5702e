"""`profile_dataset`: from a dataset and a tokenizer to a `LengthProfile` (numbers, recommendation, curves)."""

from __future__ import annotations

import os
import time

import datasets
import numpy as np
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ..data.chat_template import load_chat_template
from ..data.loading import load_dataset_source, rename_columns
from ..data.packing import STRATEGIES, plan_packing
from .lengths import PREFERENCE_PARTS, DatasetLengths, tokenize_lengths
from .numbers import (
    RandomBatches,
    SortedLengths,
    round_up,
    smallest_length_keeping,
    waste,
)
from .report import CandidateRow, LengthProfile, LengthStats, PackingRow, Recommendation

RECOMMENDATION_MULTIPLE = 64
MAX_DEFAULT_CANDIDATES = 8
# Modes whose padding waste is within this of the least are treated as equal; ties go to the first listed.
WASTE_TIE = 0.005
SFT_MODES = ("packing", "padding_free", "padded")
PREFERENCE_MODES = ("padding_free", "padded")  # as in TRL, preference configs offer padding_free, not packing
# Show a progress bar for the report stage from this many sequences on (tokenisation always shows one).
PROGRESS_MIN_SEQUENCES = 200_000
CURVE_POINTS = 200
WASTE_CURVE_POINTS = 24


def profile_dataset(
    dataset,
    tokenizer,
    *,
    max_lengths: list[int] | None = None,
    batch_size: int = 8,
    keep_threshold: float = 0.99,
    pad_to_multiple_of: int | None = None,
    dataset_text_field: str = "text",
    column_mapping: dict[str, str] | None = None,
    chat_template_path: str | None = None,
    eos_token: str | None = None,
    num_proc: int | None = None,
    seed: int = 42,
    max_examples: int | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    progress: bool | None = None,
) -> LengthProfile:
    """Profile the token lengths of `dataset` under `tokenizer`, as the SFT (or preference) trainer would see them.

    `dataset`: a `datasets.Dataset`, a `DatasetDict` (its `split` is used), a list of dicts, or a source name
    (Hub name, local folder, json/jsonl/parquet/csv file(s)). `tokenizer`: a tokenizer or its id/path.
    `column_mapping` renames columns first (e.g. {"question": "prompt", "answer": "completion"}).
    `max_lengths`: candidates to compare (default: powers of two around the data); the recommendation is
    always added. `num_proc`: tokenisation processes (default: all cores).
    """
    started = time.perf_counter()
    data, source = load_profile_dataset(dataset, dataset_config, split, max_examples, column_mapping)
    tokenizer, tokenizer_name = load_profile_tokenizer(tokenizer, chat_template_path)
    loaded = time.perf_counter()
    lengths = tokenize_lengths(data, tokenizer, dataset_text_field, eos_token, num_proc)
    tokenised = time.perf_counter()
    profile = build_profile(lengths, max_lengths=max_lengths, batch_size=batch_size, keep_threshold=keep_threshold,
                            pad_to_multiple_of=pad_to_multiple_of, seed=seed, source=source,
                            tokenizer_name=tokenizer_name, progress=progress)
    profile.seconds = {"load": loaded - started, "tokenise": tokenised - loaded,
                       "report": time.perf_counter() - tokenised}
    return profile


def load_profile_dataset(dataset, config=None, split="train", max_examples=None, column_mapping=None):
    """(datasets.Dataset, description of where it came from)."""
    source = "dataset"
    if isinstance(dataset, str):
        source = dataset
        dataset = load_dataset_source(dataset, config)
    if isinstance(dataset, (list, tuple)):
        dataset = datasets.Dataset.from_list(list(dataset))
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(f"Split {split!r} not found; the dataset has {list(dataset)}.")
        dataset = dataset[split]
        source = f"{source} [{split}]" if source != "dataset" else source
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"Cannot profile a {type(dataset).__name__}: pass a datasets.Dataset, a DatasetDict, a list "
                        "of dicts, or a dataset name or path.")
    dataset = rename_columns(dataset, column_mapping)
    if max_examples is not None and max_examples < len(dataset):
        dataset = dataset.select(range(max_examples))
    return dataset, source


def load_profile_tokenizer(tokenizer, chat_template_path: str | None = None):
    """(tokenizer, its name); a clear error when an id or path does not lead to one."""
    if tokenizer is None:
        raise ValueError("A tokenizer is needed: pass its Hub id or local folder (--tokenizer).")
    name = tokenizer if isinstance(tokenizer, str) else getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
    if isinstance(tokenizer, str):
        looks_local = tokenizer.startswith((".", "/", "~")) or os.sep * 2 in tokenizer or tokenizer.count("/") > 1
        if looks_local and not os.path.isdir(os.path.expanduser(tokenizer)):
            raise FileNotFoundError(f"Tokenizer folder not found: {tokenizer!r}.")
        try:
            tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(tokenizer))
        except (OSError, ValueError) as error:
            raise ValueError(f"Could not load a tokenizer from {name!r}: it is not a local tokenizer folder and "
                             f"could not be loaded from the Hub ({type(error).__name__}: {error}).") from None
    if chat_template_path:
        load_chat_template(tokenizer, chat_template_path)
    return tokenizer, os.path.basename(str(name).rstrip("/")) or str(name)


def default_max_lengths(lengths: SortedLengths) -> list[int]:
    """Powers of two from around the median length up to the first that fits the longest sequence."""
    low = max(64, 1 << max(0, int(lengths.percentile(50)).bit_length() - 1))
    high = max(low, 1 << max(0, int(lengths.values[-1] - 1).bit_length()))
    powers = [1 << k for k in range(low.bit_length() - 1, high.bit_length())]
    if len(powers) > MAX_DEFAULT_CANDIDATES:
        powers = powers[: MAX_DEFAULT_CANDIDATES - 1] + powers[-1:]
    return powers


def build_profile(lengths: DatasetLengths, *, max_lengths=None, batch_size: int = 8, keep_threshold: float = 0.99,
                  pad_to_multiple_of: int | None = None, seed: int = 42, source: str = "dataset",
                  tokenizer_name: str = "?", progress: bool | None = None) -> LengthProfile:
    """Every number of the profile from the lengths alone."""
    _check_settings(max_lengths, batch_size, keep_threshold, pad_to_multiple_of)
    if len(lengths.sequences) == 0:
        if lengths.kind == "preference":
            raise ValueError(f"No pair of {lengths.num_rows} is left to profile: {lengths.num_empty} have an empty "
                             f"completion and {lengths.num_identical} identical chosen and rejected.")
        raise ValueError(f"Every one of the {lengths.num_rows} examples is empty: there is nothing to profile.")
    sequences = SortedLengths.of(lengths.sequences)
    stats = {"sequences": LengthStats.of(sequences)}
    if lengths.kind == "preference":
        stats.update({name: LengthStats.of(SortedLengths.of(lengths.parts[name])) for name in PREFERENCE_PARTS})
    recommended = smallest_length_keeping(sequences, keep_threshold, RECOMMENDATION_MULTIPLE)
    chosen = sorted(set(max_lengths or default_max_lengths(sequences)) | {recommended})
    batches = RandomBatches.of(lengths.items, batch_size, seed)
    waste_grid = _waste_grid(chosen)

    show = progress if progress is not None else len(lengths.sequences) >= PROGRESS_MIN_SEQUENCES
    with tqdm(total=len(chosen) * (1 + len(STRATEGIES)) + len(waste_grid), desc="Profiling", disable=not show,
              unit="step") as bar:
        candidates = [_candidate_row(length, lengths.sequences, sequences, batches, pad_to_multiple_of, bar)
                      for length in chosen]
        curves = _curves(lengths.sequences, sequences, batches, pad_to_multiple_of, waste_grid, candidates, bar)
    by_length = {row.max_length: row for row in candidates}
    recommendation = _recommend(by_length[recommended], sequences, keep_threshold, lengths.kind, batch_size,
                                pad_to_multiple_of)
    return LengthProfile(
        source=source, tokenizer=tokenizer_name, kind=lengths.kind, data_format=lengths.data_format,
        num_rows=lengths.num_rows, num_empty=lengths.num_empty, num_identical_pairs=lengths.num_identical,
        batch_size=batch_size, pad_to_multiple_of=pad_to_multiple_of, seed=seed, stats=stats,
        candidates=candidates, recommendation=recommendation, curves=curves, lengths=lengths.sequences,
        row_lengths=lengths.row_lengths(),
    )


def _check_settings(max_lengths, batch_size, keep_threshold, pad_to_multiple_of) -> None:
    def positive(value) -> bool:
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0

    if max_lengths is not None and not all(positive(v) for v in max_lengths):
        raise ValueError(f"max_lengths must be positive integers, got {max_lengths!r}.")
    if not positive(batch_size):
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
    if pad_to_multiple_of is not None and not positive(pad_to_multiple_of):
        raise ValueError(f"pad_to_multiple_of must be a positive integer or None, got {pad_to_multiple_of!r}.")
    if not 0 < keep_threshold <= 1:
        raise ValueError(f"keep_threshold must lie in (0, 1], got {keep_threshold!r}.")


def _candidate_row(max_length: int, lengths: np.ndarray, sorted_lengths: SortedLengths, batches: RandomBatches,
                   multiple: int | None, bar) -> CandidateRow:
    num_over, tokens_lost = (int(x) for x in sorted_lengths.truncation(max_length))
    real, padded = batches.padded(max_length, multiple)
    real_free, padding_free = batches.padding_free(max_length, multiple)
    bar.update(1)
    packing = {}
    for strategy in STRATEGIES:
        # As the trainer: bfd packs truncated examples; bfd_split and wrapped take them whole and split them.
        plan = plan_packing(np.minimum(lengths, max_length) if strategy == "bfd" else lengths, max_length, strategy)
        lost = tokens_lost if strategy == "bfd" else 0
        packing[strategy] = PackingRow(strategy, plan.num_rows, float(plan.fill_ratio), plan.num_tokens, lost)
        bar.update(1)
    return CandidateRow(
        max_length=int(max_length), num_truncated=num_over, truncated_share=num_over / sorted_lengths.count,
        tokens_lost=tokens_lost, lost_share=tokens_lost / max(1, sorted_lengths.total), padded_tokens=padded,
        padded_waste=waste(real, padded), padding_free_tokens=padding_free,
        padding_free_waste=waste(real_free, padding_free), packing=packing,
    )


def _waste_grid(candidates: list[int]) -> list[int]:
    """Max lengths at which the figure draws padding waste: the candidates and multiples of 64 up to the largest."""
    top = int(round_up(candidates[-1], RECOMMENDATION_MULTIPLE))
    grid = np.linspace(RECOMMENDATION_MULTIPLE, top, num=min(WASTE_CURVE_POINTS, top // RECOMMENDATION_MULTIPLE))
    return sorted({int(round_up(int(g), RECOMMENDATION_MULTIPLE)) for g in grid} | set(candidates))


def _curves(lengths: np.ndarray, sorted_lengths: SortedLengths, batches: RandomBatches, multiple, waste_grid,
            candidates, bar) -> dict:
    """The figure's lines: kept share on a fine grid; padded, padding-free and bfd-packed waste on a coarser one."""
    longest = int(sorted_lengths.values[-1])
    kept_grid = sorted({int(x) for x in np.linspace(1, longest, num=min(CURVE_POINTS, longest))})
    profiled = {row.max_length: row for row in candidates}
    padded, padding_free, packed = [], [], []
    for length in waste_grid:
        padded.append(waste(*batches.padded(length, multiple)))
        padding_free.append(waste(*batches.padding_free(length, multiple)))
        if length in profiled:
            packed.append(profiled[length].packing["bfd"].waste)
        else:
            packed.append(1.0 - plan_packing(np.minimum(lengths, length), length, "bfd").fill_ratio)
        bar.update(1)
    return {
        "kept_share": {"max_length": kept_grid, "kept_share": sorted_lengths.kept_share(kept_grid).tolist()},
        "padding_waste": {"max_length": waste_grid, "padded": padded, "padding_free": padding_free, "bfd": packed},
    }


def _recommend(row: CandidateRow, sorted_lengths: SortedLengths, threshold: float, kind: str, batch_size: int,
               multiple: int | None) -> Recommendation:
    kept = 1.0 - row.lost_share
    unit = "pairs' sequences" if kind == "preference" else "examples"
    why_length = (
        f"{row.max_length} is the smallest multiple of {RECOMMENDATION_MULTIPLE} that keeps >= {_pct(threshold, 3)} of the tokens "
        f"(keeps {_pct(kept, 3)}; {row.num_truncated:,} of {sorted_lengths.count:,} {unit} truncated, "
        f"{row.tokens_lost:,} tokens lost; the longest has {int(sorted_lengths.values[-1]):,})"
    )
    wastes = {"packing": row.packing["bfd"].waste, "padding_free": row.padding_free_waste, "padded": row.padded_waste}
    modes = SFT_MODES if kind == "sft" else PREFERENCE_MODES
    least = min(wastes[m] for m in modes)
    mode = next(m for m in modes if wastes[m] <= least + WASTE_TIE)
    compared = ", ".join(f"{_MODE_LABELS[m]} {_pct(wastes[m], 2)}" for m in modes)
    why_mode = f"Padding waste at {row.max_length} with batches of {batch_size}: {compared}, so {_MODE_LABELS[mode]}"
    if mode == "packing":
        why_mode += " (packed rows all hold max_length tokens, so every step costs the same memory)"
    split = row.packing["bfd_split"]
    if row.tokens_lost and kind == "sft":
        why_mode += (f". bfd_split packing would keep the {row.tokens_lost:,} truncated tokens by splitting long "
                     f"examples ({split.rows:,} rows, {_pct(split.waste, 2)} padding)")
    config = [f"max_length: {row.max_length}"]
    if mode == "packing":
        config += ["packing: true", "packing_strategy: bfd"]
    elif mode == "padding_free":
        config.append("padding_free: true")
    if multiple:
        config.append(f"pad_to_multiple_of: {multiple}")
    return Recommendation(
        max_length=row.max_length, keep_threshold=threshold, kept_share=kept, mode=mode,
        packing_strategy="bfd" if mode == "packing" else None, reason=f"{why_length}. {why_mode}.",
        config_lines=config,
    )


_MODE_LABELS = {"packing": "bfd packing", "padding_free": "padding-free batches", "padded": "plain padding"}


def _pct(share: float, digits: int) -> str:
    text = f"{100 * share:.{digits}f}".rstrip("0").rstrip(".")
    return f"{text}%"
