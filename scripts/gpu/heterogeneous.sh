#!/usr/bin/env bash
# Heterogeneous layouts on a 4-GPU machine, mock-vlm (megatron-core's local modules: no transformer-engine call).
#   bash scripts/gpu/heterogeneous.sh prepare      here: fills .whl (carry.sh)
#   bash scripts/gpu/heterogeneous.sh run          device call, carry [".whl"], kind nvidia-h200-x4
# 1. Fan-in (more encoder than LLM data-parallel ranks, half the samples without an image, fp32): each layout's
#    first 10 losses against colocated data parallelism over the same global batch.
# 2. Stage overlap: a mock-vlm whose encoder and LLM take about the same time (bf16), colocated DP2 against the
#    encoder on GPU 0 and the LLM on GPU 1, with per-module timers (--log-timers), to see whether an iteration
#    takes the slower stage's time or the sum. Results in $OUT (logs, metrics).
set -uo pipefail
source "$(dirname "$0")/common.sh"
case "${1:-}" in
  prepare) bash "$CARRY_DIR/carry.sh"; exit ;;
  run) ;;
  *) echo "usage: $0 prepare|run"; exit 2 ;;
esac
use_wheels
out=${OUT:-runs/heterogeneous}; mkdir -p "$out"
versions "$out/versions.txt"
mimo() { timeout -k 10 240 python3 -m mimo.cli "$@"; }
fan=(run --provider mock-vlm --device cuda --train-iters 10 --log-interval 1 --seed 5 --micro-batch-size 4
     --global-batch-size 24 --set image_probability=0.5)
# the reference: one GPU; then colocated DP2 and the fan-in layouts (3 encoder ranks need a micro-batch of 3)
mimo "${fan[@]}" --metrics-file "$out/fan_1gpu.jsonl" > "$out/fan_1gpu.log" 2>&1
for layout in "2 0" "3 2" "4 2 --llm-tp 2" "4 3 --micro-batch-size 3"; do
  set -- $layout; n=$1; e=$2; shift 2; name="fan_${n}gpu_enc${e}${1:+_${1#--}}"
  e_args=(); [ "$e" = 0 ] || e_args=(--encoder-ranks "$e")  # 0: colocated
  mimo "${fan[@]}" --nproc-per-node "$n" "${e_args[@]}" "$@" --metrics-file "$out/$name.jsonl" \
    > "$out/$name.log" 2>&1; echo "$name exit $?"; tail -2 "$out/$name.log"
done
python3 scripts/compare_losses.py "$out"/fan_1gpu.jsonl "$out"/fan_[234]gpu*.jsonl | tail -6
[ -n "${FAN_IN_ONLY:-}" ] && exit 0
# 2. stage overlap
big=(run --provider mock-vlm --device cuda --precision bf16 --train-iters 30 --log-interval 5 --log-timers
     --micro-batch-size 1 --global-batch-size 16 --nproc-per-node 2
     --set vision_layers=16 --set vision_hidden_size=1024 --set vision_heads=16 --set image_size=512
     --set patch_size=16 --set num_layers=12 --set hidden_size=1024 --set num_attention_heads=16
     --set seq_length=2048 --set vocab_size=32000)
CUDA_VISIBLE_DEVICES=0,1 mimo "${big[@]}" --metrics-file "$out/overlap_colocated.jsonl" > "$out/overlap_colocated.log" 2>&1
CUDA_VISIBLE_DEVICES=0,1 mimo "${big[@]}" --encoder-ranks 1 --metrics-file "$out/overlap_split.jsonl" > "$out/overlap_split.log" 2>&1
for f in overlap_colocated overlap_split; do echo "== $f"; grep -E "^(iteration|time per)" "$out/$f.log" | tail -4 | cut -c1-230; done
