#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, print versions, run every row, write $OUT/results.json
# and $OUT/results.md. `--dry`: every row at tiny size on CPU (no install; the local environment's packages).
# `--tests`: first the suite's CUDA tests (cuda_tests.py; the tests that skip on CPU), their counts in the kit's table.
# See bench/gpu/README.md for the device call.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export OUT="${OUT:-$repo/gpu-results}"
mkdir -p "$OUT"
py="${PYTHON:-python3}"
dry=0 tests=0 script="$here/kit.py"
args=()
for arg in "$@"; do
  case "$arg" in
    --dry) dry=1; args+=("$arg") ;;
    --tests) tests=1 ;;
    --diagnose) script="$here/diagnose.py" ;;  # the follow-up measurements (diagnose.py's docstring), not the kit
    *) args+=("$arg") ;;
  esac
done
set -- "${args[@]}"
echo "[$(date -u +%H:%M:%S)] leantune GPU kit: $repo (dry=$dry, tests=$tests), results in $OUT"
rm -f "$OUT/cuda_tests.json"  # the table reports only this call's tests
run_cuda_tests() {  # the CUDA tests before the kit; the kit's time guard (420 s) gives up what they took
  [ "$tests" = 1 ] || return 0
  local started=$SECONDS
  timeout -k 10 "${GPUKIT_TESTS_TIMEOUT_S:-150}" "$py" "$here/cuda_tests.py" --out "$OUT" \
    $([ "$dry" = 1 ] && echo --dry) || echo "[$(date -u +%H:%M:%S)] CUDA tests: exit code $? (see above)"
  [ "$dry" = 1 ] || export GPUKIT_TOTAL_S="${GPUKIT_TOTAL_S:-$((420 - (SECONDS - started)))}"
}
"$py" "$here/carry_size.py" || echo "warning: the carried-size check failed (see above)"
if [ "$dry" = 1 ]; then
  # Liger's Triton kernels run on CPU tensors under Triton's interpreter (set before triton is first imported).
  export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
  run_cuda_tests
  exec timeout -k 10 "${GPUKIT_DRY_TIMEOUT_S:-330}" "$py" "$script" "$@"
fi
if compgen -G "$here/wheels/*.whl" >/dev/null; then
  echo "[$(date -u +%H:%M:%S)] installing $(ls "$here"/wheels/*.whl | wc -l) carried wheels into /tmp/gpukit-site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpukit-site \
    "$here"/wheels/*.whl || { echo "wheel install failed"; exit 3; }
  export PYTHONPATH="$repo:/tmp/gpukit-site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no wheels in $here/wheels: run bench/gpu/fetch_wheels.sh here and name bench/gpu/wheels in carry"
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
run_cuda_tests
# The kit's own guard stops starting rows at 420 s; this outer limit cuts a stuck kernel before the 8-minute mark.
timeout -k 10 450 "$py" "$script" "$@"
rc=$?
echo "[$(date -u +%H:%M:%S)] kit exit code $rc"
exit $rc
