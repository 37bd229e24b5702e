"""The suite's CUDA tests on the device: every test that carries a `skipif` whose reason names CUDA (they skip on the
CPU machines that run the suite) is run here, once, and the counts go to `$OUT/cuda_tests.json`, which the kit's table
(results.md) reports. `bash bench/gpu/run.sh --tests` runs this before the kit in the same call; with `--dry` it runs
on CPU, where every selected test must skip for want of CUDA (the selection and the report are what it checks).

    python bench/gpu/cuda_tests.py [--out DIR] [--dry]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def files_with_cuda_skips() -> list[str]:
    """The test files that mention a CUDA skip: only they are collected (the others may import extras the device's
    image lacks, e.g. the server's; collecting them would only deselect them)."""
    return sorted(str(path) for path in (REPO / "tests").rglob("test_*.py")
                  if re.search(r"reason=[\"'][^\"']*CUDA", path.read_text(), flags=re.IGNORECASE))


def needs_cuda(item) -> bool:
    """A test the CPU suite skips for want of CUDA (its `skipif` reason says so)."""
    return any("cuda" in str(mark.kwargs.get("reason", "")).lower() for mark in item.iter_markers("skipif"))


class CudaTests:
    """A pytest plugin: keeps the CUDA tests, records each one's outcome."""

    def __init__(self):
        self.selected: list[str] = []
        self.outcomes: dict[str, dict] = {}

    @pytest.hookimpl(trylast=True)  # after tests/conftest.py's grouping: only the selection is changed
    def pytest_collection_modifyitems(self, config, items):
        kept = [item for item in items if needs_cuda(item)]
        config.hook.pytest_deselected(items=[item for item in items if not needs_cuda(item)])
        items[:] = kept
        self.selected = [item.nodeid for item in kept]

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":  # a setup's skip or error counts; a passed setup not
            reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else None
            failure = None if report.passed or report.skipped else str(report.longrepr)[-1500:]
            self.outcomes.setdefault(report.nodeid, {"outcome": report.outcome, "seconds": round(report.duration, 2),
                                                     "reason": reason, "failure": failure})


def summary(plugin: CudaTests, exit_code: int, seconds: float, dry: bool) -> dict:
    outcomes = [plugin.outcomes.get(nodeid, {"outcome": "not_run"}) for nodeid in plugin.selected]
    counts = {name: sum(o["outcome"] == name for o in outcomes) for name in ("passed", "failed", "skipped", "not_run")}
    return {"dry": dry, "selected": len(plugin.selected), **counts, "pytest_exit_code": exit_code,
            "seconds": round(seconds, 1), "tests": dict(zip(plugin.selected, outcomes))}


def markdown_line(result: dict) -> str:
    """The kit table's line for these tests."""
    where = "CPU, dry: all must skip" if result["dry"] else "on the device"
    reasons = Counter(str(t.get("reason", "")).removeprefix("Skipped: ") for t in result["tests"].values()
                      if t["outcome"] == "skipped")
    why = "; ".join(f"{count} {reason}" for reason, count in reasons.most_common())
    return (f"CUDA tests (`run.sh --tests`, {where}): {result['selected']} selected, {result['passed']} passed, "
            f"{result['failed']} failed, {result['skipped']} skipped{f' ({why})' if why else ''}, "
            f"{result['not_run']} not run, {result['seconds']} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-results")
    parser.add_argument("--dry", action="store_true", help="on CPU: every selected test must skip for want of CUDA")
    opts = parser.parse_args(argv)
    plugin, started = CudaTests(), time.perf_counter()
    # One process (no xdist: the device runs one test at a time on its one GPU), the repository's conftest and
    # fixtures as the suite has them; -rA lists every outcome in the log.
    exit_code = pytest.main(["-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rA", "--rootdir", str(REPO),
                             "--continue-on-collection-errors", *files_with_cuda_skips()], plugins=[plugin])
    result = summary(plugin, int(exit_code), time.perf_counter() - started, opts.dry)
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    (Path(opts.out) / "cuda_tests.json").write_text(json.dumps(result, indent=1))
    print(markdown_line(result))
    if not result["selected"]:
        print("error: no test carries a CUDA skip: the selection is broken", file=sys.stderr)
        return 1
    if opts.dry:  # on CPU every one of them must skip (for want of CUDA, or of an extra that needs it): none ran
        wrong = {k: v for k, v in result["tests"].items() if v["outcome"] != "skipped"}
        if wrong:
            print(f"error: on CPU these did not skip: {wrong}", file=sys.stderr)
            return 1
        return 0
    return 0 if result["failed"] == 0 and result["not_run"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
