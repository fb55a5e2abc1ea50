#!/usr/bin/env bash
# LoRA on one GPU (bench/slice_layouts.py): the grouped-experts check, the slice with adapters on the default targets
# (routed experts included) against full fine-tuning, then the whole 52-layer model with adapters at sequence 4096.
#   here, once:                                              bash scripts/gpu/lora.sh prepare
#   device call 1, carry [".whl-te"], kind nvidia-h200:      bash scripts/gpu/lora.sh install
#   device call 2, carry [".whl"], right after call 1:       bash scripts/gpu/lora.sh run
# Results: $OUT/lora.tgz (grouped_lora.txt; slice/ and full/ with slice_layouts.json, logs and metrics), packed
# after each part; each row has the peak memory beside `mimo plan`'s estimate. The whole model's weights are drawn
# on the CPU first (host memory: about 64 GiB in bf16); each rank's stacks come every 120 s in its log.
set -uo pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/common.sh"
WORK=/tmp/lora
pack() { mkdir -p "${OUT:-runs}"; tar czf "${OUT:-runs}/lora.tgz" -C "$WORK" .; }
case "${1:-}" in
  prepare) prepare ;;
  install) install_te ;;
  run)
    use_wheels te
    export MIMO_COMPILE_CACHE=/tmp/mimo-gpu/kernel-cache
    mkdir -p "$WORK"; versions "$WORK/versions.txt"
    NVIDIA_TF32_OVERRIDE=0 timeout 120 python3 scripts/gpu/check_grouped_lora.py > "$WORK/grouped_lora.txt" 2>&1
    echo "check_grouped_lora exit $?"; grep -c '^{' "$WORK/grouped_lora.txt"; pack
    python3 bench/slice_layouts.py --out "$WORK/slice" --iterations 10 --warmup 3 --timeout 150 \
      --layouts slice-full-finetune slice-lora16 --set images_per_sample=1 --set patches_per_image=4096; pack
    MIMO_STACK_DUMP_S=120 python3 bench/slice_layouts.py --out "$WORK/full" --iterations 8 --warmup 3 \
      --timeout ${FULL_TIMEOUT:-300} --layouts full-lora16; pack
    ;;
  *) echo "usage: lora.sh prepare | install | run"; exit 2 ;;
esac
