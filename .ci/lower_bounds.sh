#!/usr/bin/env bash
# Build (or reuse) a venv with the lowest versions pyproject.toml claims (torch 2.11, transformers 5.17,
# accelerate 1.15, peft 0.21, datasets 5.0; the GPU machine's stack) and run a subset of the suite in it, one file at
# a time. Not part of .ci/run (CI time budget): run it when a lower bound changes or before a release.
#
#   bash .ci/lower_bounds.sh                    # build if needed, then run the subset
#   bash .ci/lower_bounds.sh tests/trainers/test_dpo.py  # build if needed, then run only the files given
#   LEANTUNE_LOWER_BOUNDS_VENV=/some/dir bash .ci/lower_bounds.sh
#
# torch 2.11's Linux wheel on PyPI is the CUDA 13 build (about 4.5 GB with its nvidia-* wheels); on a CPU-only
# machine it imports and runs on CPU. Building the venv takes about 7 minutes (download bound).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${LEANTUNE_LOWER_BOUNDS_VENV:-$HOME/.cache/leantune/lower-bounds-torch2.11-tf5.17}
PY=${LEANTUNE_LOWER_BOUNDS_BASE_PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The versions claimed as lower bounds in pyproject.toml; keep the two in step.
PINS=(torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 peft==0.21.0 datasets==5.0.1)
# numpy<2.4: torch 2.11 pins triton 3.6, whose interpreter (Liger's kernels on CPU, devkit/liger_cpu.py) fails under
# numpy 2.4 ("only 0-dimensional arrays can be converted to Python scalars"); compiled GPU kernels are not affected.
EXTRAS=(liger-kernel==0.8.5 bitsandbytes==0.50.2 "numpy<2.4" "pytest>=8" pytest-timeout "pytest-xdist>=3.5")

check() {
    [ -x "$VENV/bin/python" ] && (cd / && "$VENV/bin/python" - "${PINS[@]}") <<'EOF'
import importlib.metadata as md, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    assert md.version(name).split("+")[0] == version, (name, md.version(name))
import numpy, torch, transformers, accelerate, peft, datasets, liger_kernel, bitsandbytes  # noqa: F401
assert tuple(int(part) for part in numpy.__version__.split(".")[:2]) < (2, 4), numpy.__version__
EOF
}

if check 2>/dev/null; then
    echo "lower-bounds venv: reusing $VENV" >&2
else
    echo "lower-bounds venv: building $VENV (about 7 minutes)" >&2
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q "${PINS[@]}" >&2
    # leantune's other requirements, read from pyproject.toml (the pinned ones are already satisfied).
    OTHERS=$("$VENV/bin/python" - "$REPO/pyproject.toml" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
pinned = {"torch", "transformers", "accelerate", "peft", "datasets"}
print(" ".join(d for d in deps if re.split(r"[<>=!~ \[]", d)[0].lower() not in pinned))
EOF
)
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install -q "${PINS[@]}" $OTHERS "${EXTRAS[@]}" >&2
    check
fi

# The subset (one file at a time on one process) is .ci/version_subset.sh's, run with this venv's Python.
echo "lower bounds: $VENV" >&2
exec bash "$REPO/.ci/version_subset.sh" "$VENV/bin/python" "$@"
