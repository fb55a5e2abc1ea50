#!/usr/bin/env bash
# Fill .whl-tr1 ... .whl-tr4 with Triton 3.7.1 for Python 3.12, cut in parts that each fit one device call's carry
# (64 MiB): flash-linear-attention refuses the gated delta net's backward on Hopper GPUs with the GPU image's
# Triton 3.6 (its compiler gives wrong gradients from 3.4 to 3.7.0; fixed in 3.7.1). scripts/gpu/qwen.sh says how
# the parts travel and are put together. Run from the repository root.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qxF "/.whl-tr*/" "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null || echo "/.whl-tr*/" >> "$(git rev-parse --git-dir)/info/exclude"
dl=$(mktemp -d)
PYENV_VERSION=${PYENV_VERSION:-3.12.1} python3.12 -m pip download -q --no-deps --python-version 3.12 \
  --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64 -d "$dl" "triton==3.7.1" 2>&1 \
  | grep -v '^WARNING' || true
wheel=$(ls "$dl"/triton-3.7.1-*.whl)
rm -rf .whl-tr1 .whl-tr2 .whl-tr3 .whl-tr4
split -b 62000000 -d -a 1 "$wheel" "$dl/part-"
for i in 0 1 2 3; do mkdir -p .whl-tr$((i + 1)); mv "$dl/part-$i" .whl-tr$((i + 1))/; done
basename "$wheel" > .whl-tr4/name
sha256sum "$wheel" | cut -c1-64 > .whl-tr4/sha256
rm -rf "$dl"
du -sh .whl-tr*
