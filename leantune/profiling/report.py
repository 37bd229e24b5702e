"""The length profile as an object (numbers, JSON) and as the compact terminal report."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from ..data.packing import STRATEGIES
from .numbers import PERCENTILES, SortedLengths


@dataclass
class LengthStats:
    """Count, mean and nearest-rank percentiles of tokens per sequence."""

    count: int
    total_tokens: int
    mean: float
    min: int
    p50: int
    p90: int
    p95: int
    p99: int
    max: int

    @classmethod
    def of(cls, lengths: SortedLengths) -> LengthStats:
        if lengths.count == 0:
            return cls(0, 0, 0.0, 0, 0, 0, 0, 0, 0)
        percentiles = {f"p{q}": lengths.percentile(q) for q in PERCENTILES}
        return cls(count=lengths.count, total_tokens=lengths.total, mean=lengths.total / lengths.count,
                   min=int(lengths.values[0]), max=int(lengths.values[-1]), **percentiles)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PackingRow:
    """What one packing strategy makes of the data at one max_length (from `plan_packing`, as the trainer)."""

    strategy: str
    rows: int
    fill_ratio: float  # kept tokens / (rows * max_length)
    tokens_kept: int
    tokens_lost: int  # bfd only: tokens past max_length

    @property
    def waste(self) -> float:
        return 1.0 - self.fill_ratio

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class CandidateRow:
    """Every number of the report for one max_length."""

    max_length: int
    num_truncated: int
    truncated_share: float  # of sequences
    tokens_lost: int
    lost_share: float  # of all tokens
    padded_tokens: int  # plain padding: tokens in the padded batches
    padded_waste: float  # plain padding: padding / padded batch tokens
    padding_free_tokens: int
    padding_free_waste: float
    packing: dict[str, PackingRow] = field(default_factory=dict)

    def to_dict(self) -> dict:
        values = {k: v for k, v in self.__dict__.items() if k != "packing"}
        return {**values, "packing": {name: row.to_dict() for name, row in self.packing.items()}}


@dataclass
class Recommendation:
    max_length: int
    keep_threshold: float
    kept_share: float
    mode: str  # "packing", "padding_free" or "padded"
    packing_strategy: str | None
    reason: str
    config_lines: list[str]

    @property
    def cli_flags(self) -> str:
        return " ".join(f"--{line.split(': ')[0]} {line.split(': ')[1]}" for line in self.config_lines)

    def to_dict(self) -> dict:
        return {**self.__dict__, "cli_flags": self.cli_flags}


@dataclass
class LengthProfile:
    """Lengths of a dataset under a tokenizer, and what each max_length and batch layout would cost on it.

    `stats["sequences"]` describes what the trainer truncates, pads and packs (for preference data: both the
    prompt + chosen and the prompt + rejected sequences); preference profiles add prompt, chosen, rejected,
    prompt+chosen and prompt+rejected.
    """

    source: str
    tokenizer: str
    kind: str  # "sft" or "preference"
    data_format: str
    num_rows: int
    num_empty: int
    num_identical_pairs: int
    batch_size: int
    pad_to_multiple_of: int | None
    seed: int
    stats: dict[str, LengthStats]
    candidates: list[CandidateRow]
    recommendation: Recommendation
    curves: dict[str, list]  # the figure's lines: kept share and padding waste against max_length
    seconds: dict[str, float] = field(default_factory=dict)
    lengths: np.ndarray | None = field(default=None, repr=False)  # stats["sequences"]'s lengths, for the figure
    row_lengths: dict | None = field(default=None, repr=False)  # DatasetLengths.row_lengths(): `leantune plan --lengths`

    def candidate(self, max_length: int) -> CandidateRow:
        for row in self.candidates:
            if row.max_length == max_length:
                return row
        raise KeyError(f"max_length {max_length} was not profiled; profiled: {[r.max_length for r in self.candidates]}")

    def to_dict(self) -> dict:
        plain = ("source", "tokenizer", "kind", "data_format", "num_rows", "num_empty", "num_identical_pairs",
                 "batch_size", "pad_to_multiple_of", "seed", "curves", "seconds")
        return {
            **{name: getattr(self, name) for name in plain},
            "stats": {name: stats.to_dict() for name, stats in self.stats.items()},
            "candidates": [row.to_dict() for row in self.candidates],
            "recommendation": self.recommendation.to_dict(),
            **({"row_lengths": self.row_lengths} if self.row_lengths is not None else {}),
        }

    def to_json(self, path=None) -> str:
        values = self.to_dict()
        rows = values.pop("row_lengths", None)
        text = json.dumps(values, indent=2)
        if rows is not None:  # one compact line per list: a number a line would be ~3x the size
            listed = ",\n".join(f'    "{name}": {json.dumps(lengths, separators=(",", ":"))}'
                                 for name, lengths in rows.items())
            text = text[:-2] + ',\n  "row_lengths": {\n' + listed + "\n  }\n}"
        if path is not None:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")
        return text

    def format_text(self) -> str:
        return "\n".join(_header(self) + [""] + _candidate_table(self) + [""] + _recommendation_lines(self))

    def __str__(self) -> str:
        return self.format_text()


def _percent(share: float, digits: int = 1) -> str:
    return f"{100 * share:.{digits}f}%"


def _header(profile: LengthProfile) -> list[str]:
    unit = "pairs" if profile.kind == "preference" else "examples"
    title = (f"{profile.num_rows:,} {unit} of {profile.source} ({profile.kind}, {profile.data_format}), "
             f"tokenizer {profile.tokenizer}")
    lines = [title]
    if profile.kind == "sft":
        lines.append(f"{profile.num_empty:,} empty examples (the trainer drops them; not counted below)")
    else:
        lines.append(f"{profile.num_identical_pairs:,} pairs with chosen == rejected, {profile.num_empty:,} pairs "
                     "with an empty completion (the DPO trainer drops them; not counted below)")
    names = list(profile.stats)
    width = max(len(name) for name in names + ["tokens per example"])
    lines.append(f"{'':<{width}}  {'count':>9}  {'mean':>8}  " + "  ".join(f"{c:>7}" for c in
                                                                           ("p50", "p90", "p95", "p99", "max")))
    for name in names:
        stats = profile.stats[name]
        label = "tokens per example" if name == "sequences" and profile.kind == "sft" else name
        if name == "sequences" and profile.kind == "preference":
            label = "all sequences"
        cells = "  ".join(f"{v:>7,}" for v in (stats.p50, stats.p90, stats.p95, stats.p99, stats.max))
        lines.append(f"{label:<{width}}  {stats.count:>9,}  {stats.mean:>8.1f}  {cells}")
    return lines


def _candidate_table(profile: LengthProfile) -> list[str]:
    multiple = f", padded to a multiple of {profile.pad_to_multiple_of}" if profile.pad_to_multiple_of else ""
    rows_note = "pairs (2 rows each)" if profile.kind == "preference" else "examples"
    batches = f"random batches of {profile.batch_size} {rows_note} (seed {profile.seed}){multiple}"
    lines = [
        f"per max_length: padding waste (padding / batch tokens) with {batches}, each padded to its longest",
        "(padded) or flattened to one row (pad-free); packing into rows of max_length tokens: rows (fill ratio)",
    ]
    header = (f"  {'max_length':>10}  {'truncated':>9}  {'tokens lost':>11}  {'padded':>7}  {'pad-free':>8}  "
              + "  ".join(f"{name:>18}" for name in STRATEGIES))
    lines.append(header)
    for row in profile.candidates:
        mark = ">" if row.max_length == profile.recommendation.max_length else " "
        packing = "  ".join(
            f"{row.packing[name].rows:>9,} ({_percent(row.packing[name].fill_ratio, 2):>7})" for name in STRATEGIES
        )
        lines.append(
            f"{mark} {row.max_length:>10,}  {_percent(row.truncated_share, 2):>9}  {_percent(row.lost_share, 2):>11}  "
            f"{_percent(row.padded_waste):>7}  {_percent(row.padding_free_waste):>8}  {packing}"
        )
    lines.append("  (bfd truncates at max_length like padding does; bfd_split and wrapped cut long sequences into "
                 "pieces and lose no token)")
    return lines


def _recommendation_lines(profile: LengthProfile) -> list[str]:
    rec = profile.recommendation
    lines = [f"recommendation: max_length {rec.max_length}, {_mode_name(rec)}", f"  why: {rec.reason}",
             "  config (YAML):"]
    lines += [f"    {line}" for line in rec.config_lines]
    lines.append(f"  flags: {rec.cli_flags}")
    return lines


def _mode_name(rec: Recommendation) -> str:
    if rec.mode == "packing":
        return f"packing with {rec.packing_strategy}"
    return "padding-free batches" if rec.mode == "padding_free" else "plain padding"
