#!/usr/bin/env bash
# te against local for every built-in provider: fp32, TF32 off, same seed, 10 iterations; the losses of each
# pair compared (docs/verification.md holds them to 1e-4 relative). Needs transformer-engine, mamba-ssm and a GPU.
#   bash scripts/gpu/te_parity.sh OUT [PROVIDER ...]      (default: every built-in provider)
# Two comparisons per provider: from the seed (each backend draws its own initial weights), and from shared
# weights (both load the weights the local backend saved after one iteration, `--pretrained`; a provider whose
# backends name their parameters differently cannot share them, and says so).
set -uo pipefail
out=${1:-runs/te_parity}
shift || true
providers=("$@")
[ ${#providers[@]} -gt 0 ] || providers=(mock-vlm nemotron-moe-vlm-tiny)
mkdir -p "$out"
export NVIDIA_TF32_OVERRIDE=0
train() {  # NAME BACKEND [mimo run options...]
  local name=$1 backend=$2; shift 2
  python3 -m mimo.cli run --provider "$provider" --set backend="$backend" --device cuda --precision fp32 \
    --log-interval 1 --seed 1234 "$@" > "$out/$name.log" 2>&1 || { echo "$name failed:"; tail -5 "$out/$name.log"; }
}
for provider in "${providers[@]}"; do
  for backend in local te; do
    train "${provider}_$backend" $backend --train-iters 10 --metrics-file "$out/${provider}_$backend.jsonl"
  done
  python3 scripts/compare_losses.py "$out/${provider}_local.jsonl" "$out/${provider}_te.jsonl" | tee "$out/${provider}.txt"
  train "${provider}_init" local --train-iters 1 --save "$out/${provider}_init" --save-interval 1
  for backend in local te; do
    train "${provider}_shared_$backend" $backend --train-iters 10 --pretrained "$out/${provider}_init" \
      --metrics-file "$out/${provider}_shared_$backend.jsonl"
  done
  if [ -s "$out/${provider}_shared_te.jsonl" ]; then
    python3 scripts/compare_losses.py "$out/${provider}_shared_local.jsonl" "$out/${provider}_shared_te.jsonl" \
      | tee "$out/${provider}_shared.txt"
  else
    echo "$provider: te did not load local's weights: $(grep -m1 error "$out/${provider}_shared_te.log")"
  fi
done
