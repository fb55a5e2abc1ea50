#!/usr/bin/env bash
# Two-GPU check of heterogeneous layouts (run on a 2-GPU machine with mimo and megatron-core installed):
# mock-vlm with the encoder on GPU 0 and the LLM on GPU 1 (NCCL bridge) against colocated data parallelism on
# both GPUs, same seed and global batch, fp32; first 10 losses compared. Writes metrics under $1.
set -euo pipefail
out=${1:-runs/layouts}
mkdir -p "$out"
mimo() { python3 -m mimo.cli "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
common=(run --provider mock-vlm --device cuda --train-iters 10 --log-interval 1 --seed 5 --micro-batch-size 2
        --global-batch-size 12 --set image_probability=0.5 --nproc-per-node 2)
mimo "${common[@]}" --encoder-ranks 1 --metrics-file "$out/hetero.jsonl"
mimo "${common[@]}" --metrics-file "$out/colocated.jsonl"
python3 scripts/compare_losses.py "$out/colocated.jsonl" "$out/hetero.jsonl"
python3 - "$out/colocated.jsonl" "$out/hetero.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
for key in ("grad_norm_images", "grad_norm_language"):
    print(key, "max relative difference", max(abs(x[key] - y[key]) / x[key] for x, y in zip(a, b)))
PY
