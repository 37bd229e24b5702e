"""What one device call carries: the working tree that travels (tracked files and untracked files git does not
ignore) plus the wheel folder named in `carry`. The device takes 64 MiB a call; the kit keeps under 60 MiB.

Run by bench/gpu/run.sh and fetch_wheels.sh, and by tests/benchmarks/test_gpu_kit.py (`--json`: the counts, the pins
and their measured sizes, for a test to read). Without fetched wheels it counts the sizes they had when measured
(KNOWN_WHEEL_BYTES, pinned in wheels.txt), so the check holds offline."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LIMIT_BYTES = 60 * 1024 * 1024
# Measured 2026-11-27 with fetch_wheels.sh (the cp312 manylinux x86_64 wheels of wheels.txt's pins).
KNOWN_WHEEL_BYTES = {
    "bitsandbytes": 43_139_553, "datasets": 608_276, "dill": 120_019, "liger-kernel": 910_117,
    "multiprocess": 150_281, "trl": 948_205,
    # 2026-11-29, for run.sh --tests
    "pytest": 375_249, "pluggy": 20_538, "iniconfig": 7_484, "pygments": 1_231_151,
}


def pinned_names() -> list[str]:
    lines = (HERE / "wheels.txt").read_text().splitlines()
    return [line.split("==")[0].strip() for line in lines if line.strip() and not line.startswith("#")]


def tree_bytes(repo: Path = REPO) -> int:
    """Tracked plus untracked-not-ignored files (what the device call sends), as git lists them."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                           capture_output=True, check=True).stdout.split(b"\0")
    total = 0
    for name in filter(None, names):
        path = repo / name.decode()
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def wheel_bytes(folder: Path) -> tuple[int, str]:
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if wheels:
        return sum(w.stat().st_size for w in wheels), f"{len(wheels)} wheels in {folder}"
    missing = [n for n in pinned_names() if n not in KNOWN_WHEEL_BYTES]
    if missing:
        raise SystemExit(f"bench/gpu/carry_size.py: no measured size for {missing}: run bench/gpu/fetch_wheels.sh")
    return sum(KNOWN_WHEEL_BYTES[n] for n in pinned_names()), "wheels not fetched: their measured sizes"


def check(wheels: Path = HERE / "wheels", repo: Path = REPO) -> dict:
    try:
        tree = tree_bytes(repo)
    except (OSError, subprocess.CalledProcessError):  # a copy without git (the device machine): not counted there
        tree = 0
    wheel_total, source = wheel_bytes(wheels)
    total = tree + wheel_total
    return {"tree_bytes": tree, "wheel_bytes": wheel_total, "wheel_source": source, "total_bytes": total,
            "limit_bytes": LIMIT_BYTES, "ok": total < LIMIT_BYTES}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, default=HERE / "wheels")
    parser.add_argument("--repo", type=Path, default=REPO, help="the git tree that travels (default: this repository)")
    parser.add_argument("--json", action="store_true",
                        help="print the counts, the pins and their measured sizes as JSON")
    opts = parser.parse_args(argv)
    result = check(opts.wheels, opts.repo)
    if opts.json:
        print(json.dumps({**result, "pinned_names": pinned_names(), "known_wheel_bytes": KNOWN_WHEEL_BYTES}))
        return 0 if result["ok"] else 2
    mib = 1024 * 1024
    print(f"carried: tree {result['tree_bytes'] / mib:.1f} MiB + wheels {result['wheel_bytes'] / mib:.1f} MiB "
          f"({result['wheel_source']}) = {result['total_bytes'] / mib:.1f} MiB of {LIMIT_BYTES / mib:.0f} MiB")
    if not result["ok"]:
        print("error: the carried size is over the limit: trim the tree or the wheels", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
