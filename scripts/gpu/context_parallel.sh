#!/usr/bin/env bash
# Context parallelism of the LLM (--llm-cp, docs/parallelism.md) on 2 GPUs of one machine: the same data with CP 1
# (one GPU) and CP 2 (two GPUs), each pair's losses and gradient norms printed side by side with their largest
# relative difference. From the repository root:
#   here, once:                                                  bash scripts/gpu/context_parallel.sh prepare
#   device call 1, carry [".whl-te"], kind nvidia-h200-x2:       bash scripts/gpu/context_parallel.sh install
#   device call 2, carry [".whl"], right after call 1:           bash scripts/gpu/context_parallel.sh run
#   optional call 3, carry [".whl"], same machine:               bash scripts/gpu/context_parallel.sh slice
# run: 1. mock-vlm, backend local, fp32 (mimo's SDPAttention gathering keys and values): CP 2 should match CP 1
#         within fp32 tolerance (about 1e-5 relative).
#      2. mock-vlm, backend te, bf16 (transformer-engine's ring attention; TE runs CP only in its flash and fused
#         attention, which take no fp32): within bf16 tolerance (about 1e-2 relative on the loss).
#      3. nemotron-moe-vlm-tiny, backend te, bf16 (Mamba layers through megatron-core's MambaContextParallel).
#      4. as 3 with packed --data (`mimo data sample`, written here): transformer-engine splits each packed sample
#         over CP, padded to a multiple of 2 x CP; 8 samples of about 75 tokens a pack fill one 1024-token row with
#         and without that padding, so both runs train on the same packs.
# packed: the fourth pair of run alone.
# slice: the full-width Nemotron slice at seq_length 32768 with two 4096-patch images a sample, CP 2 on both GPUs
#        (ms/iteration, peak memory), then the same with CP 1 (DP 2), which may not fit: the memory check then
#        refuses it in one line (docs/benchmarks/context_parallel_gpu.json's runs: 8 iterations, 2 H200s).
# Results: logs and metrics under $OUT; the comparisons are the last output. ITERATIONS (10) overrides.
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCH_COMPILE_DISABLE=1
source "$(dirname "$0")/common.sh"
out=${OUT:-runs/context_parallel}
iterations=${ITERATIONS:-10}
mimo() { timeout -k 10 "$limit" python3 -m mimo.cli "$@"; }

# pair NAME OPTIONS...: one run with CP 1 on GPU 0, one with CP 2 on GPUs 0-1, same seed and global batch
pair() {
  local name=$1
  shift
  local common=(run --device cuda --log-interval 1 --seed 5 --train-iters "$iterations" "$@")
  CUDA_VISIBLE_DEVICES=0 mimo "${common[@]}" --metrics-file "$out/${name}_cp1.jsonl" > "$out/${name}_cp1.log" 2>&1
  echo "$name cp1 exit $?"; tail -3 "$out/${name}_cp1.log" | cut -c1-250
  mimo "${common[@]}" --nproc-per-node 2 --llm-cp 2 --metrics-file "$out/${name}_cp2.jsonl" \
    > "$out/${name}_cp2.log" 2>&1
  echo "$name cp2 exit $?"; tail -3 "$out/${name}_cp2.log" | cut -c1-250
}

# compare NAME...: per iteration, CP 1 and CP 2 loss and gradient norm, and the largest relative differences
compare() {
  python3 - "$out" "$@" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in sys.argv[2:]:
    runs = []
    for cp in (1, 2):
        path = out / f"{name}_cp{cp}.jsonl"
        runs.append({r["iteration"]: r for r in map(json.loads, path.open())} if path.exists() else {})
    common = sorted(set(runs[0]) & set(runs[1]))
    print(f"== {name}: iteration, loss CP1, loss CP2, grad norm CP1, grad norm CP2")
    worst = {"lm_loss": 0.0, "grad_norm": 0.0}
    for it in common:
        a, b = runs[0][it], runs[1][it]
        print(f"{it:>4} {a['lm_loss']:.9f} {b['lm_loss']:.9f} {a['grad_norm']:.9f} {b['grad_norm']:.9f}")
        for key in worst:
            worst[key] = max(worst[key], abs(a[key] - b[key]) / abs(a[key]))
    print(f"{name}: {len(common)} iterations compared; largest relative difference: loss {worst['lm_loss']:.3e}, "
          f"grad norm {worst['grad_norm']:.3e}" if common else f"{name}: nothing to compare (see the logs)")
EOF
}

# packed_pair: run's fourth pair (nemotron-moe-vlm-tiny, te, bf16) on packed --data
packed_pair() {
  local data=/tmp/mimo-gpu/packed_data  # no network on the GPU machine: a synthetic captioning dataset written here
  rm -rf "$data"
  mimo data sample "$data" --num-samples 64 > "$out/packed_data.log" 2>&1
  echo "packed data exit $?"; tail -1 "$out/packed_data.log" | cut -c1-250
  pair nemotron_tiny_te_bf16_packed --provider nemotron-moe-vlm-tiny --set backend=te --precision bf16 \
    --micro-batch-size 1 --num-microbatches 4 --set seq_length=1024 --data "$data" --packing-buffer-size 8
}

case "${1:-}" in
  prepare) prepare; exit ;;
  install) install_te; exit ;;
  run|slice|packed) ;;
  *) echo "usage: context_parallel.sh prepare | install | run | slice | packed"; exit 2 ;;
esac
use_wheels te
mkdir -p "$out"
versions "$out/versions.txt"
export MIMO_COMPILE_CACHE=/tmp/mimo-gpu/kernel-cache
if [ "$1" = run ]; then
  limit=150
  mock=(--provider mock-vlm --micro-batch-size 2 --global-batch-size 8 --set seq_length=1024
        --set image_probability=0.5)
  pair mock_local_fp32 "${mock[@]}" --set backend=local
  pair mock_te_bf16 "${mock[@]}" --set backend=te --precision bf16
  limit=240  # the first te iteration compiles mamba-ssm's Triton kernels
  pair nemotron_tiny_te_bf16 --provider nemotron-moe-vlm-tiny --set backend=te --precision bf16 \
    --micro-batch-size 1 --num-microbatches 4 --set seq_length=1024
  packed_pair
  compare mock_local_fp32 mock_te_bf16 nemotron_tiny_te_bf16 nemotron_tiny_te_bf16_packed
elif [ "$1" = packed ]; then
  limit=240
  packed_pair
  compare nemotron_tiny_te_bf16_packed
else
  limit=280
  # two 4096-patch images a sample: every image of one size, so the peaks can be held to the plan's estimate
  slice=(run --device cuda --provider nemotron-moe-vlm-52l --set 'hybrid_pattern=MEMEM*EMEM' --set num_experts=16
         --set backend=te --precision bf16 --micro-batch-size 1 --num-microbatches 4 --set seq_length=32768
         --set images_per_sample=2 --set patches_per_image=4096
         --train-iters "${ITERATIONS:-8}" --log-interval 1 --seed 5 --nproc-per-node 2)
  mimo "${slice[@]}" --llm-cp 2 --metrics-file "$out/slice_cp2.jsonl" > "$out/slice_cp2.log" 2>&1
  echo "slice cp2 exit $?"; grep -E "^(iteration|error)" "$out/slice_cp2.log" | tail -4 | cut -c1-250
  mimo "${slice[@]}" --metrics-file "$out/slice_dp2.jsonl" > "$out/slice_dp2.log" 2>&1
  echo "slice dp2 (CP 1) exit $?"; grep -E "^(iteration|error)" "$out/slice_dp2.log" | tail -4 | cut -c1-250
fi
