#!/usr/bin/env bash
# GPU checks on one GPU (mimo and megatron-core installed): CPU/CUDA parity of the foundation, checkpoint resume
# on CUDA with save/load times, reported TFLOP/s against torch's FLOP counter at a GPU-sized mock-vlm, and the
# Nemotron mid-size variant in bf16 with the local backend. Writes metrics and logs under $1.
set -euo pipefail
out=${1:-runs/h100}
mkdir -p "$out"
mimo() { python3 -m mimo.cli "$@"; }
bash scripts/gpu/foundation.sh "$out/foundation"

echo "== checkpoint: save at 5, resume to 10 (CUDA, fp32)"
ck=(run --provider mock-vlm --device cuda --train-iters 10 --log-interval 1 --set image_probability=0.5)
mimo "${ck[@]}" --save "$out/ckpt" --save-interval 5 --metrics-file "$out/ckpt_full.jsonl"
mkdir -p "$out/ckpt5" && cp -r "$out/ckpt/iter_0000005" "$out/ckpt5/" && echo 5 > "$out/ckpt5/latest_checkpointed_iteration.txt"
mimo "${ck[@]}" --load "$out/ckpt5" --metrics-file "$out/ckpt_resumed.jsonl"
python3 scripts/compare_losses.py "$out/ckpt_full.jsonl" "$out/ckpt_resumed.jsonl"

echo "== TFLOP/s at a GPU-sized mock-vlm (bf16)"
mimo run --provider mock-vlm --device cuda --precision bf16 --train-iters 30 --log-interval 10 --micro-batch-size 4 \
  --flop-check-iteration 25 --metrics-file "$out/flops.jsonl" \
  --set image_size=448 --set patch_size=16 --set vision_hidden_size=1024 --set vision_layers=12 --set vision_heads=16 \
  --set hidden_size=2048 --set num_layers=16 --set num_attention_heads=16 --set seq_length=2048 --set vocab_size=32000 \
  --set image_probability=1.0

echo "== nemotron-moe-vlm-mid (bf16, local backend)"
mimo run --provider nemotron-moe-vlm-mid --device cuda --precision bf16 --train-iters 10 --log-interval 5 \
  --micro-batch-size 4 --metrics-file "$out/nemotron_mid.jsonl"
