"""The profile as one PNG: length histogram, tokens kept against max_length, padding waste against max_length.

Drawn with matplotlib's object API on an Agg canvas, so it never touches pyplot's global state or needs a display.
"""

from __future__ import annotations

import numpy as np

from .report import LengthProfile

HISTOGRAM_BINS = 60


def write_length_figure(profile: LengthProfile, path) -> str:
    """Write the figure to `path` (PNG) and return the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(16, 4.6), layout="constrained")
    FigureCanvasAgg(figure)
    histogram, kept, padding = figure.subplots(1, 3)
    recommended = profile.recommendation.max_length
    _histogram(histogram, profile, recommended)
    _kept_share(kept, profile, recommended)
    _padding_waste(padding, profile, recommended)
    unit = "sequences (prompt + chosen, prompt + rejected)" if profile.kind == "preference" else "examples"
    figure.suptitle(f"{profile.source}: {profile.stats['sequences'].count:,} {unit}, tokenizer {profile.tokenizer}; "
                    f"recommended max_length {recommended}", fontsize=11)
    figure.savefig(path, format="png", dpi=110)
    return str(path)


def _mark(axis, recommended: int) -> None:
    axis.axvline(recommended, color="tab:red", linestyle="--", linewidth=1.2, label=f"recommended {recommended}")


def _histogram(axis, profile: LengthProfile, recommended: int) -> None:
    lengths = np.asarray(profile.lengths if profile.lengths is not None else [], dtype=np.int64)
    if len(lengths):
        axis.hist(lengths, bins=HISTOGRAM_BINS, color="tab:blue", alpha=0.8)
    stats = profile.stats["sequences"]
    axis.axvline(stats.p50, color="gray", linewidth=1, label=f"p50 {stats.p50}")
    axis.axvline(stats.p99, color="black", linewidth=1, label=f"p99 {stats.p99}")
    _mark(axis, recommended)
    axis.set(title="tokens per sequence", xlabel="tokens", ylabel="sequences")
    axis.legend(fontsize=8)


def _kept_share(axis, profile: LengthProfile, recommended: int) -> None:
    curve = profile.curves["kept_share"]
    axis.plot(curve["max_length"], 100 * np.asarray(curve["kept_share"]), color="tab:green")
    threshold = profile.recommendation.keep_threshold
    axis.axhline(100 * threshold, color="gray", linestyle=":", linewidth=1, label=f"threshold {100 * threshold:g}%")
    _mark(axis, recommended)
    axis.plot([recommended], [100 * profile.recommendation.kept_share], "o", color="tab:red")
    axis.set(title="tokens kept after truncation", xlabel="max_length", ylabel="% of tokens kept")
    axis.legend(fontsize=8, loc="lower right")


def _padding_waste(axis, profile: LengthProfile, recommended: int) -> None:
    padding = profile.curves["padding_waste"]
    axis.plot(padding["max_length"], 100 * np.asarray(padding["padded"]), color="tab:orange",
              label=f"padded (batch {profile.batch_size})")
    axis.plot(padding["max_length"], 100 * np.asarray(padding["bfd"]), ".-", color="tab:purple", label="packed (bfd)")
    axis.plot(padding["max_length"], 100 * np.asarray(padding["padding_free"]), color="tab:cyan",
              label="padding-free")
    _mark(axis, recommended)
    axis.set(title="padding waste", xlabel="max_length", ylabel="% of batch tokens that are padding")
    axis.set_ylim(bottom=0)
    axis.legend(fontsize=8)
