#!/usr/bin/env bash
# The Nemotron slice's layouts on two GPUs of one machine (bench/slice_layouts.py): colocated DP2, colocated EP2
# and RADIO on GPU 0 + LLM on GPU 1, on the workload where the encoder carries half the FLOPs (two 4096-patch images
# per sample), one call. From the repository root:
#   here, once:                                                bash scripts/gpu/slice_layouts.sh prepare
#   device call 1, carry [".whl-te"], kind nvidia-h200-x2:     bash scripts/gpu/slice_layouts.sh install
#   device call 2, carry [".whl"], right after call 1:         bash scripts/gpu/slice_layouts.sh run
# Results: $OUT/slice_layouts.json (rows), the logs and metrics under $OUT; the table is the last output.
# LAYOUTS (default: all three), ITERATIONS (16) and SETTINGS override the defaults.
set -uo pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/common.sh"
case "${1:-}" in
  prepare) prepare ;;
  install) install_te ;;
  run)
    use_wheels te
    export MIMO_COMPILE_CACHE=/tmp/mimo-gpu/kernel-cache  # the first layout compiles, the others reuse it
    versions "${OUT:-runs}/versions.txt"
    settings=(${SETTINGS:---set images_per_sample=2 --set patches_per_image=4096})
    python3 bench/slice_layouts.py --out "${OUT:-runs}" --iterations "${ITERATIONS:-16}" --warmup 6 --timeout 230 \
      --layouts ${LAYOUTS:-colocated-dp2 colocated-ep2 split-1+1} "${settings[@]}"
    ;;
  *) echo "usage: slice_layouts.sh prepare | install | run"; exit 2 ;;
esac
