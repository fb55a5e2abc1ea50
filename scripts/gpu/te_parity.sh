#!/usr/bin/env bash
# te against local for every built-in provider: fp32, TF32 off, same seed, 10 iterations; the losses of each
# pair compared (docs/verification.md holds them to 1e-4 relative). Needs transformer-engine, mamba-ssm and a GPU.
#   bash scripts/gpu/te_parity.sh OUT [PROVIDER ...]      (default: every built-in provider)
set -uo pipefail
out=${1:-runs/te_parity}
shift || true
providers=("$@")
[ ${#providers[@]} -gt 0 ] || providers=(mock-vlm nemotron-moe-vlm-tiny)
mkdir -p "$out"
export NVIDIA_TF32_OVERRIDE=0
for provider in "${providers[@]}"; do
  for backend in local te; do
    python3 -m mimo.cli run --provider "$provider" --set backend=$backend --device cuda --precision fp32 \
      --train-iters 10 --log-interval 1 --seed 1234 --metrics-file "$out/${provider}_$backend.jsonl" \
      > "$out/${provider}_$backend.log" 2>&1 || { echo "$provider $backend failed:"; tail -5 "$out/${provider}_$backend.log"; }
  done
  python3 scripts/compare_losses.py "$out/${provider}_local.jsonl" "$out/${provider}_te.jsonl" | tee "$out/${provider}.txt"
done
