#!/usr/bin/env bash
# Run the one-process subset of the suite that checks leantune on another set of versions, with the Python of a venv
# that has them (the lower bounds: .ci/lower_bounds.sh builds that venv and calls this; a newer or older transformers:
# a venv of its own, e.g. `python -m venv --system-site-packages V && V/bin/pip install transformers==X`).
#
#   bash .ci/version_subset.sh /path/to/venv/bin/python                       # the whole subset
#   bash .ci/version_subset.sh /path/to/venv/bin/python tests/trainers/test_dpo.py  # only the files given
#
# One file at a time on one process: no multi-process, DeepSpeed or TRL-script files.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=$1
shift
FILES=("$@")
if [ ${#FILES[@]} -eq 0 ]; then
    FILES=(tests/losses/test_sft_exactness.py tests/trainers/test_dpo.py tests/trainers/test_kto.py tests/data/test_packing.py
           tests/losses/test_chunked_logprobs.py tests/memory/test_memory_engine.py tests/planning/test_plan.py tests/models/test_quantization.py
           tests/losses/test_liger_cpu.py tests/memory/test_offloading.py tests/cli/test_cli.py tests/trainers/test_grpo.py)
fi
cd "$REPO"
export PYTHONPATH=$REPO OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PYTHON" -c "import sys, torch, transformers, accelerate, peft, datasets, numpy; print('versions: python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__, 'datasets', datasets.__version__, 'numpy', numpy.__version__)"
STATUS=0
for f in "${FILES[@]}"; do
    echo "== $f" >&2
    # Left out: test_grpo.py's two-process runs (the subset stays on one process).
    K=()
    case $(basename "$f") in
        test_grpo.py) K=(-k "not two_processes") ;;
    esac
    "$PYTHON" -m pytest -q -p no:cacheprovider -n 0 "${K[@]}" "$f" || STATUS=1
done
exit $STATUS
