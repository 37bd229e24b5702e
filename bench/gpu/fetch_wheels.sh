#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (cp312, manylinux x86_64) into bench/gpu/wheels (git-ignored; it travels
# as a `carry` path, see bench/gpu/README.md). Needs PyPI; run it on this machine, never on the GPU machine.
# The image already has torch 2.11, transformers 5.17, accelerate, peft, triton, pyarrow, pandas, xxhash, fsspec,
# requests, httpx, huggingface-hub, tqdm, pyyaml, numpy, packaging: only what is missing from it is fetched.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="${1:-$here/wheels}"
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform any -d "$dest" -r "$here/wheels.txt"
python3 "$here/carry_size.py" --wheels "$dest"
