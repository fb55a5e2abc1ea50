#!/usr/bin/env bash
# The dense 1.65B mock-vlm on one H100 at its best recipe (transformer-engine, CUDA graphs, FP8 tensorwise,
# micro-batch 4 x 2): TFLOP/s and MFU (docs/benchmarks.md (f) and (g), README's 553 TFLOP/s, 55.9% MFU).
# bench/te_path.py's dense-te-graphs-fp8-mbs4 with every default (the encoders once per step), this checkout
# first on an empty kernel cache, then beside it in turn the encoders once per micro-batch (`--encoder-pass
# micro-batch`), or a prepared commit's code instead. From the repository root:
#   here, once:                                  bash scripts/gpu/dense.sh prepare [COMMIT]
#   device call 1, carry [".whl-te"], 420 s:     bash scripts/gpu/dense.sh install
#   device call 2, carry [".whl"], 600 s:        bash scripts/gpu/dense.sh run
# (call 2 right after call 1: scripts/gpu/common.sh). Results: $OUT/dense.tgz; the summary table is the last
# output. DENSE_ITERATIONS (11, 3 of warm-up) and LIMIT (540) override the defaults.
set -uo pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/common.sh"
case "${1:-}" in
  prepare) prepare "${2:-}" ;;
  install) install_te ;;
  run) use_wheels te
       measure dense dense-te-graphs-fp8-mbs4 "${DENSE_ITERATIONS:-11}" 3 150 "--extra=--encoder-pass micro-batch" ;;
  *) echo "usage: dense.sh prepare [COMMIT] | install | run"; exit 2 ;;
esac
