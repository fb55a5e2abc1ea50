#!/usr/bin/env bash
# The Nemotron slice's layouts on two GPUs of one machine (bench/slice_layouts.py): colocated DP2, colocated EP2
# and RADIO on GPU 0 + LLM on GPU 1, on the workload where the encoder carries half the FLOPs (two 4096-patch images
# per sample), one call. From the repository root:
#   here, once:                                                bash scripts/gpu/slice_layouts.sh prepare
#   device call 1, carry [".whl-te"], kind nvidia-h200-x2:     bash scripts/gpu/slice_layouts.sh install
#   device call 2, carry [".whl"], right after call 1:         bash scripts/gpu/slice_layouts.sh run
# Results: $OUT/slice_layouts.json (rows), the logs and metrics under $OUT; the table is the last output.
# LAYOUTS (default: all three), ITERATIONS (16) and SETTINGS override the defaults. Instead of `run`, call 2 may
# be `adapters-and-packed-cp`, `experts-and-fp8` or `diagnose` (the checks and layouts their comments below name);
# their results come back as $OUT/slice_layouts.tgz.
set -uo pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/common.sh"
work=/tmp/slice_layouts  # the modes' logs and records, packed into $OUT/slice_layouts.tgz after each step
start_call() {  # call 2's set-up: the wheels, one kernel cache for every run of the call, the versions on record
  use_wheels te
  export MIMO_COMPILE_CACHE=/tmp/mimo-gpu/kernel-cache
  mkdir -p "$work"; versions "$work/versions.txt"
}
pack() { mkdir -p "${OUT:-runs}"; tar czf "${OUT:-runs}/.r.$BASHPID.tgz" -C "$work" . && \
         mv -f "${OUT:-runs}/.r.$BASHPID.tgz" "${OUT:-runs}/slice_layouts.tgz"; }
case "${1:-}" in
  prepare) prepare ;;
  install) install_te ;;
  run)
    use_wheels te
    export MIMO_COMPILE_CACHE=/tmp/mimo-gpu/kernel-cache  # the first layout compiles, the others reuse it
    versions "${OUT:-runs}/versions.txt"
    settings=(${SETTINGS:---set images_per_sample=2 --set patches_per_image=4096})
    python3 bench/slice_layouts.py --out "${OUT:-runs}" --iterations "${ITERATIONS:-16}" --warmup 6 --timeout 230 \
      --layouts ${LAYOUTS:-colocated-dp2 colocated-ep2 split-1+1} "${settings[@]}"
    ;;
  adapters-and-packed-cp|experts-and-fp8)
    start_call
    one() {  # GPUS OUT_SUBDIR TIMEOUT LAYOUT...: bench/slice_layouts.py, 10 iterations, the first 4 left out
      CUDA_VISIBLE_DEVICES=$1 python3 bench/slice_layouts.py --out "$work/$2" --iterations 10 --warmup 4 \
        --timeout "$3" --layouts "${@:4}" > "$work/$2.txt" 2>&1
    }
    # the grouped-experts LoRA check on GPU 0 (with its transformer-engine fallback and FP8 parts), beside the rest
    ( CUDA_VISIBLE_DEVICES=0 NVIDIA_TF32_OVERRIDE=0 timeout 150 python3 scripts/gpu/check_grouped_lora.py \
        > "$work/grouped_lora.txt" 2>&1; echo "check_grouped_lora exit $?" >> "$work/grouped_lora.txt" ) &
    if [ "$1" = adapters-and-packed-cp ]; then  # issues 50 and 51: packed CP 1 against CP 2 on GPUs 0-1, then the
      # slice with adapters on one GPU each: without graphs and with, FP8, shared-outer
      ( OUT="$work/packed_cp" MIMO_WHEELS_READY=1 bash scripts/gpu/context_parallel.sh packed ) \
        > "$work/packed_cp.txt" 2>&1
      wait; tail -6 "$work/grouped_lora.txt"; tail -14 "$work/packed_cp.txt"; pack
      one 0 lora_plain 150 slice-lora16 slice-lora16-fp8 & one 1 lora_more 150 slice-lora16-graphs slice-lora16-shared-outer
      wait; tail -5 "$work/lora_plain.txt"; tail -5 "$work/lora_more.txt"; pack
    else  # issues 50 and 48: the slice with adapters under FP8 on GPU 1; then on both GPUs DP 2 against EP 2, and
      # both again with balanced (random) routing (the call recorded ran EP 2 by all-gather too: a dispatcher
      # tried at commit 343b869, slower, since removed)
      one 1 lora_fp8 150 slice-lora16-fp8
      wait; tail -12 "$work/grouped_lora.txt"; tail -6 "$work/lora_fp8.txt"; pack
      one 0,1 experts 120 colocated-dp2 colocated-ep2 colocated-dp2-balanced colocated-ep2-balanced
      tail -30 "$work/experts.txt"; pack
    fi
    ;;
  diagnose|remeasure)  # issue 48's two open gaps, for the record. Memory: the CP comparison's 8k workload (two 4096-patch
    # images a sample) on one GPU each, the weights drawn on the GPU (GPU 0) and on the CPU (GPU 1), the allocator
    # recorded to iteration 2 and what was live at each peak listed (scripts/memory_at_peak.py). Time: DP 2 and
    # EP 2 profiled (iterations 6-7; the summaries come back, the traces are left out: too large)
    start_call
    slice=(run --device cuda --provider nemotron-moe-vlm-52l --set 'hybrid_pattern=MEMEM*EMEM' --set backend=te
           --precision bf16 --micro-batch-size 1 --num-microbatches 8 --cuda-graphs --log-interval 1 --seed 5)
    memory() {  # GPU NAME OPTIONS...
      local gpu=$1 name=$2; shift 2
      CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 240 python3 -m mimo.cli "${slice[@]}" --set num_experts=16 \
        --set images_per_sample=2 --set patches_per_image=4096 --train-iters 3 --memory-snapshot-dir "/tmp/mem_$name" \
        --metrics-file "$work/mem_$name.jsonl" "$@" > "$work/mem_$name.log" 2>&1
      echo "memory $name exit $?" >> "$work/mem_$name.log"
      timeout 120 python3 scripts/memory_at_peak.py "/tmp/mem_$name" --top 50 --json "$work/mem_$name.json" \
        > "$work/mem_$name.txt" 2>&1
    }
    if [ "$1" = remeasure ]; then  # after the expert stacks' fix: the 8k workload drawn on the CPU, then the
      # one-GPU runs of lora_gpu.json's memory test as they were recorded (weights drawn on the CPU)
      memory 0 cpu-drawn-fixed --init-device cpu
      tail -2 "$work/mem_cpu-drawn-fixed.log" | cut -c1-200; head -16 "$work/mem_cpu-drawn-fixed.txt"; pack
      one_gpu=(run --device cuda --provider nemotron-moe-vlm-52l --set 'hybrid_pattern=MEMEM*EMEM' --set num_experts=16
               --set backend=te --precision bf16 --micro-batch-size 1 --num-microbatches 4 --train-iters 10
               --log-interval 1 --seed 5 --set images_per_sample=1 --set patches_per_image=4096 --init-device cpu)
      for name in lora-no-routed-experts full-finetune; do
        extra=(); [ "$name" = full-finetune ] || extra=(--lora-rank 16 --lora-targets
                                                        language:linear_qkv,linear_proj,in_proj,out_proj,shared_experts)
        timeout -k 10 150 python3 -m mimo.cli "${one_gpu[@]}" "${extra[@]}" --metrics-file "$work/$name.jsonl" \
          > "$work/$name.log" 2>&1
        echo "$name exit $?"; grep "^iteration" "$work/$name.log" | tail -2 | cut -c1-250
      done
      pack; exit 0
    fi
    gpus=$(nvidia-smi -L | wc -l)
    if [ "$gpus" -ge 2 ]; then memory 0 gpu-drawn & memory 1 cpu-drawn --init-device cpu; wait
    else memory 0 gpu-drawn; memory 0 cpu-drawn --init-device cpu; fi  # one GPU: in turn, and no profiles
    for name in gpu-drawn cpu-drawn; do tail -2 "$work/mem_$name.log" | cut -c1-200; head -30 "$work/mem_$name.txt"; done
    pack
    [ "$gpus" -ge 2 ] || exit 0
    profile() {  # NAME OPTIONS...
      local name=$1; shift
      timeout -k 10 150 python3 -m mimo.cli "${slice[@]}" --nproc-per-node 2 --train-iters 8 --profile-dir \
        "$work/profile_$name" --profile-step-start 6 --profile-step-end 7 --metrics-file "$work/profile_$name.jsonl" \
        "$@" > "$work/profile_$name.log" 2>&1
      echo "profile $name exit $?"; grep -A24 "^profile (" "$work/profile_$name.log" | cut -c1-200
      rm -f "$work/profile_$name"/trace_rank*.json
    }
    profile dp2 --set num_experts=16; pack
    profile ep2 --set num_experts=32 --llm-ep 2; pack
    ;;
  one-gpu)  # issue 48 on one GPU: megatron-core's dispatcher (counts to the host, a wait per MoE layer and
    # micro-batch, the chunk sort) against mimo's device counts on the slice, in turn on the same data, the baseline
    # again last (scripts/gpu/dispatch_paths.py): expert parallelism's price beside its all-to-all. Then issue 50's
    # grouped-experts LoRA check with its FP8 part (bf16), and whether NCCL EP (the flex dispatcher) is there.
    start_call
    python3 -c "import torch; print('nccl', torch.cuda.nccl.version())
import megatron.core.transformer.moe.fused_a2a as a; print('NCCL EP for megatron-core:', a.nccl_ep_dispatch is not None)" \
      > "$work/ncclep.txt" 2>&1; tail -2 "$work/ncclep.txt"
    slice=(run --device cuda --provider nemotron-moe-vlm-52l --set 'hybrid_pattern=MEMEM*EMEM' --set backend=te
           --set num_experts=16 --precision bf16 --micro-batch-size 1 --num-microbatches 8 --cuda-graphs
           --log-interval 1 --seed 5 --train-iters 14)
    path() {  # NAME device|host [OPTIONS]
      local name=$1 mode=$2; shift 2
      timeout -k 10 "${CAP:-150}" python3 scripts/gpu/dispatch_paths.py "$mode" "${slice[@]}" \
        --metrics-file "$work/$name.jsonl" "$@" > "$work/$name.log" 2>&1
      echo "$name exit $?"; grep "^iteration" "$work/$name.log" | tail -1 | cut -c1-220
    }
    CAP=200 path device device; path host host; path host-eager-router host --set moe_router_graphs=false
    path device-again device
    for other in host host-eager-router device-again; do
      python3 scripts/gpu/dispatch_paths.py compare "$work/device.jsonl" "$work/$other.jsonl" --skip 4
    done | tee "$work/compare.txt"
    pack
    left=$(( 560 - SECONDS )); (( left < 40 )) && left=40
    NVIDIA_TF32_OVERRIDE=0 timeout -k 10 "$left" python3 scripts/gpu/check_grouped_lora.py \
      --precision bf16 > "$work/grouped_lora_bf16.txt" 2>&1; echo "check_grouped_lora exit $?"
    cut -c1-400 "$work/grouped_lora_bf16.txt" | grep -v Warning | tail -8; pack
    ;;
  ep-profile)  # issue 48 on two GPUs: DP 2, EP 2 (its routers graphed) and EP 2 with eager routers as rows of
    # layouts_gpu.json (bench/slice_layouts.py, 10 iterations); then DP 2 and EP 2 profiled (iterations 6-7: GPU
    # time by kind, idle time by host operation, the host's waits) with NCCL's transport between the GPUs, and EP 2
    # without the shared expert's side stream; summaries come back, the traces are left out (too large)
    start_call; nvidia-smi topo -m > "$work/topo.txt"
    slice=(run --device cuda --provider nemotron-moe-vlm-52l --set 'hybrid_pattern=MEMEM*EMEM' --set backend=te
           --precision bf16 --micro-batch-size 1 --num-microbatches 8 --cuda-graphs --log-interval 1 --seed 5)
    profile() {  # NAME OPTIONS...
      local name=$1; shift
      NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT timeout -k 10 150 python3 -m mimo.cli "${slice[@]}" --nproc-per-node 2 \
        --train-iters 8 --profile-dir "$work/profile_$name" --profile-step-start 6 --profile-step-end 7 \
        --metrics-file "$work/profile_$name.jsonl" "$@" > "$work/profile_$name.log" 2>&1
      echo "profile $name exit $?"; grep -m3 " via " "$work/profile_$name.log" | cut -c1-160
      grep -A24 "^profile (" "$work/profile_$name.log" | cut -c1-200
      rm -f "$work/profile_$name"/trace_rank*.json
    }
    python3 bench/slice_layouts.py --out "$work/rows" --iterations 10 --warmup 4 --timeout 150 \
      --layouts colocated-dp2 colocated-ep2 colocated-ep2-eager-routers > "$work/rows.txt" 2>&1
    tail -8 "$work/rows.txt"; pack
    profile dp2 --set num_experts=16; pack
    profile ep2 --set num_experts=32 --llm-ep 2; pack
    (( SECONDS < 450 )) && profile ep2-no-side-stream --set num_experts=32 --llm-ep 2 --set shared_expert_overlap=false; pack
    ;;
  *) echo "usage: slice_layouts.sh prepare | install | run | adapters-and-packed-cp | experts-and-fp8 | diagnose |" \
          "remeasure | one-gpu | ep-profile"
     exit 2 ;;
esac
