#!/usr/bin/env bash
# The Nemotron slice at production width on one H100: TFLOP/s, MFU, first iteration (docs/benchmarks.md (g),
# README's 402-409 TFLOP/s). bench/te_path.py's slice-te-graphs with every default, 45 iterations (12 of warm-up
# left out), this checkout first on an empty kernel cache, then again on the warm one; with a prepared commit,
# that commit and this checkout in turn beside it. From the repository root:
#   here, once:                                  bash scripts/gpu/slice.sh prepare [COMMIT]
#   device call 1, carry [".whl-te"], 420 s:     bash scripts/gpu/slice.sh install
#   device call 2, carry [".whl"], 600 s:        bash scripts/gpu/slice.sh run
# (call 2 right after call 1: scripts/gpu/common.sh). Results: $OUT/slice.tgz; the summary table is the last
# output. SLICE_ITERATIONS (45) and LIMIT (seconds for the call's runs, 540) override the defaults; 100 iterations
# give two runs per call.
set -uo pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/common.sh"
case "${1:-}" in
  prepare) prepare "${2:-}" ;;
  install) install_te ;;
  run) use_wheels te; measure slice slice-te-graphs "${SLICE_ITERATIONS:-45}" 12 240 ;;
  *) echo "usage: slice.sh prepare [COMMIT] | install | run"; exit 2 ;;
esac
