#!/usr/bin/env bash
# Issue 63, item 3: separate layouts on shared GPUs on a machine with 2 GPUs (kind nvidia-h200-x2). A workload whose
# LLM runs TP2 (bench/layouts.py --shared: a ViT-H-class encoder at 4096 patches beside an 8-layer GPT at hidden
# 5120, sequence 8192, bf16), both modules on both GPUs: one layout (the encoder at TP2 too) against separate
# layouts (the encoder at TP1, data-parallel beside the LLM's TP2); target: separate >= 1.2x. No transformer-engine
# needed. From the repository root:
#   here, once:                                  bash scripts/gpu/shared_layouts.sh prepare
#   device call, carry [".whl"], 600 s:          bash scripts/gpu/shared_layouts.sh run
# Results: $OUT/shared_layouts.tgz (logs, metrics, layouts.json); the table is the last output.
set -uo pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/common.sh"
case "${1:-}" in
  prepare) bash "$CARRY_DIR/carry.sh" ;;
  run)
    use_wheels
    R=/tmp/mimo-gpu/shared_layouts
    mkdir -p "$R"
    versions "$R/versions.txt"
    timeout -k 10 560 python3 bench/layouts.py --out "$R" --shared --iterations "${SHARED_ITERATIONS:-20}" 2>&1 \
      | tee "$R/console.log"
    tar czf "$OUT/shared_layouts.tgz" -C /tmp/mimo-gpu shared_layouts
    ;;
  *) echo "usage: shared_layouts.sh prepare | run"; exit 2 ;;
esac
