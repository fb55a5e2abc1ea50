#!/usr/bin/env bash
# Qwen3.5-VL on one GPU (issue 62; docs/benchmarks.md, "Qwen3.5-VL on one GPU"): the production-width 35B-A3B
# slice (bench/real_data.py's qwen-slice: every released width, 16 of 40 layers, the 32 experts one GPU holds under
# EP8; its routed experts the kit's grouped GEMMs, expert_gemm auto) on synthetic data, the same with --cuda-graphs
# (qwen-slice-graphs: the mixers and MoE routers captured), then qwen-slice on the real-shaped dataset, in one
# call. QWEN_TINY=1 first checks the te backend on the tiny MoE model with packed data (about 120 s, most of it
# Triton's autotuning).
#
# flash-linear-attention refuses the gated delta net's backward on Hopper GPUs with the image's Triton 3.6 (wrong
# gradients from 3.4 to 3.7.0), so Triton 3.7.1 travels along, in four parts (a call carries 64 MiB at most).
# From the repository root:
#   here, once:                                  bash scripts/gpu/qwen.sh prepare
#   device call 1, carry [".whl-te"], 420 s:     bash scripts/gpu/qwen.sh install
#   device calls 2-4, carry [".whl-trN"], 60 s:  bash scripts/gpu/qwen.sh part N       (N = 1, 2, 3)
#   device call 5, carry [".whl", ".whl-tr4"]:   bash scripts/gpu/qwen.sh run
#   then, on the same machine (MIMO_WHEELS_READY=1): bash scripts/gpu/qwen.sh lora     (the whole 35B-A3B with
#                                                LoRA 16 on the real-shaped data, within its plan)
# (each call right after the one before: scripts/gpu/common.sh). Results: $OUT/qwen.tgz, rewritten after each step.
# QWEN_ITERATIONS (15) and QWEN_WARMUP (5) set the slice's iterations: each of the three runs has a third of the
# call's time left after the set-up (about 170 s; the first iteration autotunes for about 40 s, graphs capture in
# the second).
set -uo pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/common.sh"
R=/tmp/mimo-gpu/qwen
pack() {  # the Triton choices autotuned here come back too: pinned per shape (the kernel_configs hook), they spare
          # a fresh machine's first iteration the autotuning, as Nemotron's do
  cp /tmp/mimo-gpu/kernel-cache/kernel_configs.json "$R/" 2>/dev/null
  tar czf "$OUT/qwen.tgz" --exclude='trace_*' --exclude='*.pickle' -C /tmp/mimo-gpu qwen 2>/dev/null; true
}
dataset() {  # the real-shaped dataset, made on the machine (about 10 s on 16 cores)
  test -d /tmp/mimo-gpu/real/dataset || python3 bench/real_shaped_data.py --out /tmp/mimo-gpu/real --workers 8 \
    2>&1 | tail -3
}
triton_3_7() {  # the parts put together and installed into /tmp/triton-site, ahead of the image's Triton
  if [ ! -f /tmp/triton-site/ok ]; then
    cp .whl-tr4/part-* /tmp/triton-parts/ 2>/dev/null
    local wheel=/tmp/triton-wheel/$(cat .whl-tr4/name)
    mkdir -p /tmp/triton-wheel && cat /tmp/triton-parts/part-* > "$wheel"
    [ "$(sha256sum "$wheel" | cut -c1-64)" = "$(cat .whl-tr4/sha256)" ] \
      || { echo "triton parts missing or damaged: $(ls /tmp/triton-parts)"; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/triton-site "$wheel" \
      && touch /tmp/triton-site/ok || return 1
  fi
  export PYTHONPATH=/tmp/triton-site:$PYTHONPATH
  # torch's compiler (megatron-core's fused functions) with this Triton: kept on only if it compiles
  python3 -c "import torch, triton; f = torch.compile(lambda x: x * 2 + 1); f(torch.ones(8, device='cuda')); \
print('triton', triton.__version__, 'torch.compile works')" 2>&1 | tail -1 | tee -a "$R/versions.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || { export TORCH_COMPILE_DISABLE=1; echo "torch.compile off" | tee -a "$R/versions.txt"; }
}
case "${1:-}" in
  prepare) prepare && bash "$(dirname "$0")/carry_triton.sh" ;;
  install) install_te ;;
  part) mkdir -p /tmp/triton-parts && cp ".whl-tr$2"/part-* /tmp/triton-parts/ && ls /tmp/triton-parts ;;
  run)
    use_wheels te
    mkdir -p "$R"
    export MIMO_COMPILE_CACHE=/tmp/mimo-gpu/kernel-cache
    versions "$R/versions.txt"
    triton_3_7 || exit 3
    python3 -c "import transformers, fla; print('transformers', transformers.__version__, 'fla', fla.__version__)" \
      2>&1 | tee -a "$R/versions.txt"
    dataset
    if [ "${QWEN_TINY:-0}" = 1 ]; then
      # the te backend (transformer-engine layers, fla's gated delta-net kernels) on the tiny MoE model, packed data
      timeout -k 10 150 python3 -m mimo.cli run --provider qwen3.5-vl-moe-tiny --set backend=te --device cuda \
        --precision bf16 --train-iters 6 --log-interval 1 --data /tmp/mimo-gpu/real/dataset \
        --metrics-file "$R/tiny_te.jsonl" > "$R/tiny_te.log" 2>&1
      echo "== tiny te, packed real-shaped data: exit $?"; tail -4 "$R/tiny_te.log"
      pack
    fi
    steps=(--iterations "${QWEN_ITERATIONS:-15}" --warmup "${QWEN_WARMUP:-5}")
    each=$(( (530 - SECONDS) / 3 ))  # seconds per run; the nested timeouts stay within the call's 560
    timeout -k 10 $(( 2 * each + 10 )) python3 bench/real_data.py --out "$R/slice" \
      --data /tmp/mimo-gpu/real/dataset --cases qwen-slice qwen-slice-graphs --only synthetic "${steps[@]}" \
      --timeout "$each" 2>&1 | tee -a "$R/console.log"
    pack
    left=$(( 540 - SECONDS ))
    if [ "$left" -gt 60 ]; then
      timeout -k 10 $(( left + 10 )) python3 bench/real_data.py --out "$R/slice-real" \
        --data /tmp/mimo-gpu/real/dataset --cases qwen-slice --only real "${steps[@]}" --timeout "$(( left - 5 ))" \
        2>&1 | tee -a "$R/console.log"
    else
      echo "== qwen-slice-real: left out, ${left} s left" | tee -a "$R/console.log"
    fi
    pack
    ;;
  lora)
    use_wheels te
    mkdir -p "$R"
    triton_3_7 || exit 3
    export MIMO_COMPILE_CACHE=/tmp/mimo-gpu/kernel-cache
    dataset
    timeout -k 10 540 python3 bench/real_data.py --out "$R/lora" --data /tmp/mimo-gpu/real/dataset \
      --cases qwen-lora --only real --iterations 10 --warmup 4 --timeout 520 2>&1 | tee -a "$R/console.log"
    pack
    ;;
  *) echo "usage: qwen.sh prepare | install | part N | run | lora"; exit 2 ;;
esac
