#!/usr/bin/env bash
# GPU check of the foundation (run on one GPU, with mimo and megatron-core installed): the same mock-vlm run in
# fp32 on the CPU and on CUDA (first 10 losses compared), then a bf16 run on CUDA. Writes metrics under $1.
set -euo pipefail
out=${1:-runs/foundation}
mkdir -p "$out"
mimo() { python3 -m mimo.cli "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
common=(run --provider mock-vlm --train-iters 10 --log-interval 1 --seed 1234)
mimo "${common[@]}" --device cpu --metrics-file "$out/cpu_fp32.jsonl"
mimo "${common[@]}" --device cuda --metrics-file "$out/cuda_fp32.jsonl"
python3 scripts/compare_losses.py "$out/cpu_fp32.jsonl" "$out/cuda_fp32.jsonl"
mimo run --provider mock-vlm --device cuda --precision bf16 --train-iters 50 --log-interval 10 \
  --metrics-file "$out/cuda_bf16.jsonl"
