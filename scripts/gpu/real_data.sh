#!/usr/bin/env bash
# Real-shaped data beside synthetic on one GPU (docs/benchmarks.md (h), docs/benchmarks/real_data_gpu.json): the
# slice and mid, each synthetic then on the real-shaped dataset with the same options, in one call per case. From
# the repository root:
#   here, once:                                  bash scripts/gpu/real_data.sh prepare
#   device call 1, carry [".whl-te"], 420 s:     bash scripts/gpu/real_data.sh install
#   device call 2, carry [".whl"], 600 s:        bash scripts/gpu/real_data.sh run slice
#   device call 3, carry [".whl"], 600 s:        bash scripts/gpu/real_data.sh run mid
#   or, on a fresh machine after call 1:         bash scripts/gpu/real_data.sh first   (the slice's first iteration
#                                                on the real-shaped data alone, 3 iterations, empty kernel cache)
#   or, after call 1:                            bash scripts/gpu/real_data.sh probe   (what was live at the memory
#                                                peak of the slice and mid, synthetic and real-shaped, 3 iterations
#                                                each, beside mimo plan; then the whole 52-layer model with LoRA 16 and
#                                                the Qwen3.5-VL 35B-A3B slice on the real-shaped data)
# (each call right after the one before: scripts/gpu/common.sh). The dataset is made on the machine (2000 records,
# about 10 s on 16 cores). Results: $OUT/real_data.tgz; the summary table is the last output.
# REAL_ITERATIONS (40) and REAL_WARMUP (10) override the defaults.
set -uo pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/common.sh"
case "${1:-}" in
  prepare) prepare ;;
  install) install_te ;;
  run|first|probe)
    pack() {  # what has finished comes back even if a later step runs into the call's limit
      cp /tmp/mimo-gpu/kernel-cache/kernel_configs.json "$results/" 2>/dev/null  # the choices autotuned here
      tar czf "$OUT/real_data.tgz" --exclude='trace_*' --exclude='*.pickle' -C /tmp/mimo-gpu real_data 2>/dev/null
    }
    use_wheels te
    results=/tmp/mimo-gpu/real_data
    mkdir -p "$results"
    export MIMO_COMPILE_CACHE=/tmp/mimo-gpu/kernel-cache
    versions "$results/versions.txt"
    test -d /tmp/mimo-gpu/real/dataset || python3 bench/real_shaped_data.py --out /tmp/mimo-gpu/real --workers 8 \
      2>&1 | tail -12
    if [ "$1" = probe ]; then
      for c in slice:125 mid:75; do  # case:seconds for each of its two runs
        timeout -k 10 $(( 2 * ${c#*:} + 10 )) python3 bench/real_data.py --out "$results/probe" \
          --data /tmp/mimo-gpu/real/dataset --cases ${c%:*} --iterations 3 --warmup 1 --timeout ${c#*:} --snapshot \
          2>&1 | tee -a "$results/console.log"
        pack
      done
      timeout -k 10 140 python3 bench/real_data.py --out "$results/lora52" --data /tmp/mimo-gpu/real/dataset \
        --cases lora52 --only real --iterations 10 --warmup 4 --timeout 130 2>&1 | tee -a "$results/console.log"
      pack  # the steps' limits (260 + 160 + 140 s) leave the rest of 560 s to the last
      left=$(( 560 - SECONDS )); (( left > 60 )) && timeout -k 10 $left python3 bench/real_data.py \
        --out "$results/qwen" --data /tmp/mimo-gpu/real/dataset --cases qwen-slice --iterations 15 --warmup 5 \
        --timeout $(( left / 2 )) 2>&1 | tee -a "$results/console.log"
    elif [ "$1" = first ]; then
      timeout -k 10 300 python3 bench/real_data.py --out "$results/first" --data /tmp/mimo-gpu/real/dataset \
        --cases slice --only real --iterations 3 --warmup 0 --timeout 280 2>&1 | tee -a "$results/console.log"
    else
      timeout -k 10 540 python3 bench/real_data.py --out "$results/${2:-slice}" --data /tmp/mimo-gpu/real/dataset \
        --cases "${2:-slice}" --iterations "${REAL_ITERATIONS:-40}" --warmup "${REAL_WARMUP:-10}" --timeout 260 \
        2>&1 | tee -a "$results/console.log"
    fi
    pack
    ;;
  *) echo "usage: real_data.sh prepare | install | run [slice|mid|lora52|qwen-slice] | first | probe"; exit 2 ;;
esac
