#!/usr/bin/env bash
# Four GPUs of one machine (bench/slice_layouts.py): the whole model and the slice's layouts, two run calls.
#   here, once:                                                bash scripts/gpu/four_gpus.sh prepare
#   device call 1, carry [".whl-te"], kind nvidia-h200-x4:     bash scripts/gpu/four_gpus.sh install
#   device call 2, carry [".whl"], right after call 1:         bash scripts/gpu/four_gpus.sh run-a
#   device call 3, carry [".whl"], right after call 2:         bash scripts/gpu/four_gpus.sh run-b
# run-a: mock-vlm on 2 GPUs with each --optimizer-precision (losses, and a bf16 save resumed), then
#        nemotron-moe-vlm-52l at full size (RADIO-H + the released 52-layer LLM, 128 experts) with EP4, full
#        recompute and the distributed optimizer with bf16 moments and gradients (--optimizer-precision bf16),
#        then the slice (MEMEM*EMEM) colocated DP4 (16 experts) and EP4 (64 experts: 16 a GPU) on its default data.
# run-b: the slice with two 4096-patch images a sample (RADIO about half the FLOPs): colocated DP4 against the
#        split `mimo plan --suggest --gpus 4` ranks first (RADIO on ranks 0-1, the LLM EP2 on ranks 2-3), then on the
#        default data colocated DP4 again against its first split there (RADIO on rank 0, the LLM DP3 on ranks 1-3).
# run-full: the whole model alone (each rank's Python stacks every 90 s in its log, the GPUs' memory every 20 s),
#        then the slice's EP4 and DP4 while the call's time lasts.
# run-c: scripts/gpu/check_grouped_lora.py (LoRA on the te backend's grouped experts), then run-b's first part.
# run-d: the whole model again (its start-up line names where the time went: the CPU draws now run on each rank's
#        share of the cores), then the slice's EP4 with and without --overlap-grad-reduce.
# run-e: the slice on a fresh machine with its weights drawn on the GPUs (--init-device auto): EP4 first (its
#        first iteration and start-up phases), DP4, EP4 with --overlap-grad-reduce, RADIO on rank 0 + the LLM DP3.
# run-f: three jobs at once: GPU 0 the LoRA check and the whole model with adapters at sequence 4096 (one GPU);
#        GPUs 1-3 the heterogeneous CP check (nemotron-moe-vlm-tiny, te, bf16: RADIO on one rank + the LLM CP 2,
#        against CP 1), then on GPUs 1-2 the slice's DP2 and EP2, and CP2 at 32768 beside DP2 at 8192 (two images).
# run-g: what issue 52 still asks of four GPUs: `nemotron-moe-vlm-54l` at full size (EP4, full recompute,
#        --optimizer-precision bf16) and the 52-layer model again (its start-up with the weights drawn on the GPUs);
#        fan-in on GPUs (nemotron-moe-vlm-tiny, te, bf16: RADIO on 2 ranks feeding the LLM on 1, against
#        colocated on one GPU, the same global batch); the slice's EP4 and DP4 profiled (iterations 6-7).
# run-h: issue 63's fan-in of the Nemotron slice (RADIO on GPUs 0-1 feeding the slice's LLM on GPU 2) against the
#        slice colocated on GPU 3, the same seed and global batch, bf16: their losses compared (three GPUs used).
# Results: $OUT/four_gpus.tgz: <part>/slice_layouts.json (rows), logs and metrics; the table is each part's last
# output.
set -uo pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/common.sh"
WORK=/tmp/four_gpus  # results gather here; $OUT gets one archive of them after each part (a call brings back
                    # few files, and a call stopped at its time limit keeps what the parts before wrote)
pack() {  # jobs running at once pack in turn: each writes its own file, then renames it over the archive
  mkdir -p "${OUT:-runs}"; local part="${OUT:-runs}/.four_gpus.$BASHPID.tgz"
  tar czf "$part" -C "$WORK" . 2>/dev/null; mv -f "$part" "${OUT:-runs}/four_gpus.tgz"
}
layouts() {  # OUT_SUBDIR ITERATIONS TIMEOUT LAYOUT... [-- SETTINGS...]
  local out="$WORK/$1" iterations=$2 timeout=$3; shift 3
  local names=() settings=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do names+=("$1"); shift; done
  [ $# -gt 0 ] && shift && settings=("$@")
  python3 bench/slice_layouts.py --out "$out" --iterations "$iterations" --warmup 5 --timeout "$timeout" \
    --layouts "${names[@]}" "${settings[@]}"
  pack
}
optimizer_precision() {  # OUT_DIR: mock-vlm on 2 GPUs, bf16, the three --optimizer-precision choices' losses, and
  # a bf16 run saved at iteration 6 and resumed to 12 against the same run uninterrupted
  local out="$WORK/$1"; mkdir -p "$out"
  local run=(timeout -k 10 120 python3 -m mimo.cli run --provider mock-vlm --device cuda --precision bf16
             --nproc-per-node 2 --use-distributed-optimizer --train-iters 12 --log-interval 1 --seed 5
             --micro-batch-size 4 --global-batch-size 32)
  for p in fp32 bf16-moments bf16; do
    CUDA_VISIBLE_DEVICES=0,1 "${run[@]}" --optimizer-precision "$p" --metrics-file "$out/$p.jsonl" > "$out/$p.log" 2>&1
    echo "optimizer-precision $p: exit $? $(grep -c '^ *iteration' "$out/$p.log") iterations"
  done
  CUDA_VISIBLE_DEVICES=0,1 "${run[@]}" --optimizer-precision bf16 --train-iters 6 --save "$out/ckpt" \
    --metrics-file "$out/bf16_first.jsonl" > "$out/bf16_first.log" 2>&1
  CUDA_VISIBLE_DEVICES=0,1 "${run[@]}" --optimizer-precision bf16 --load "$out/ckpt" \
    --metrics-file "$out/bf16_resumed.jsonl" > "$out/bf16_resumed.log" 2>&1
  echo "resume: exit $? $(grep -c '^ *iteration' "$out/bf16_resumed.log") iterations"; rm -rf "$out/ckpt"
  python3 scripts/compare_losses.py "$out/fp32.jsonl" "$out/bf16-moments.jsonl" "$out/bf16.jsonl" | tail -14
  python3 scripts/compare_losses.py "$out/bf16.jsonl" "$out/bf16_resumed.jsonl" | tail -1
  pack
}
tiny_run() {  # OUT_DIR NAME GPUS OPTIONS...: one run of the caller's `run` command into OUT_DIR/NAME.{jsonl,log}
  local out=$1 name=$2 gpus=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpus "${run[@]}" "$@" --metrics-file "$out/$name.jsonl" > "$out/$name.log" 2>&1
  echo "$name exit $?"; tail -2 "$out/$name.log" | cut -c1-250
}
hetero_cp() {  # OUT_DIR: RADIO on GPU 1 and the LLM on GPU 2 (CP 1) against the LLM CP 2 on GPUs 2-3
  local out="$WORK/$1"; mkdir -p "$out"
  local run=(timeout -k 10 200 python3 -m mimo.cli run --provider nemotron-moe-vlm-tiny --set backend=te --device cuda
             --precision bf16 --encoder-ranks 1 --micro-batch-size 1 --num-microbatches 4 --set seq_length=1024
             --train-iters 10 --log-interval 1 --seed 5 --init-device cpu)
  tiny_run "$out" cp1 1,2 --nproc-per-node 2
  tiny_run "$out" cp2 1,2,3 --nproc-per-node 3 --llm-cp 2
  python3 scripts/compare_losses.py "$out/cp1.jsonl" "$out/cp2.jsonl" | tail -3
  pack
}
fan_in() {  # OUT_DIR: RADIO on GPUs 0-1 feeding the LLM on GPU 2 against colocated on GPU 3, the same batch
  local out="$WORK/$1"; mkdir -p "$out"
  local run=(timeout -k 10 200 python3 -m mimo.cli run --provider nemotron-moe-vlm-tiny --set backend=te --device cuda
             --precision bf16 --micro-batch-size 2 --global-batch-size 16 --set image_probability=0.5
             --train-iters 10 --log-interval 1 --seed 5 --init-device cpu)
  tiny_run "$out" colocated 3
  tiny_run "$out" fan_in 0,1,2 --nproc-per-node 3 --encoder-ranks 2
  python3 scripts/compare_losses.py "$out/colocated.jsonl" "$out/fan_in.jsonl" | tail -3
  pack
}
fan_in_slice() {  # OUT_DIR: as fan_in, the production-width slice (16 experts, te, bf16)
  local out="$WORK/$1"; mkdir -p "$out"
  local run=(timeout -k 10 260 python3 -m mimo.cli run --provider nemotron-moe-vlm-52l --set 'hybrid_pattern=MEMEM*EMEM'
             --set num_experts=16 --set backend=te --device cuda --precision bf16 --micro-batch-size 2
             --global-batch-size 8 --train-iters 10 --log-interval 1 --seed 5 --init-device cpu)
  tiny_run "$out" colocated 3
  tiny_run "$out" fan_in 0,1,2 --nproc-per-node 3 --encoder-ranks 2
  python3 scripts/compare_losses.py "$out/colocated.jsonl" "$out/fan_in.jsonl" | tail -3
  pack
}
case "${1:-}" in
  prepare) prepare ;;
  install) install_te ;;
  run-a|run-b|run-c|run-d|run-e|run-f|run-g|run-h|run-full)
    use_wheels te
    export MIMO_COMPILE_CACHE=/tmp/mimo-gpu/kernel-cache  # the first layout compiles, the others reuse it
    mkdir -p "$WORK"; versions "$WORK/versions.txt"
    if [ "$1" = run-e ]; then  # a fresh machine: EP4's first iteration is the record
      MIMO_SLOW_START_S=0 layouts slice_e 12 150 colocated-ep4 colocated-dp4 colocated-ep4-overlap split-1+3
    elif [ "$1" = run-g ]; then
      MIMO_SLOW_START_S=0 layouts full 8 ${FULL_TIMEOUT:-200} full54-ep4 full-ep4
      fan_in fan_in
      for layout in ep4 dp4; do
        experts=$([ $layout = ep4 ] && echo 64 || echo 16)
        options=(); [ $layout = ep4 ] && options=(--llm-ep 4)
        timeout -k 10 150 python3 -m mimo.cli run --device cuda --provider nemotron-moe-vlm-52l \
          --set 'hybrid_pattern=MEMEM*EMEM' --set backend=te --set num_experts=$experts --precision bf16 \
          --micro-batch-size 1 --num-microbatches 8 --nproc-per-node 4 --cuda-graphs --train-iters 8 \
          --log-interval 1 --seed 5 "${options[@]}" --profile-dir "$WORK/profile_$layout" --profile-step-start 6 \
          --profile-step-end 7 > "$WORK/profile_$layout.log" 2>&1
        echo "profile $layout exit $?"; grep -A24 "^profile (" "$WORK/profile_$layout.log" | cut -c1-200
        rm -f "$WORK/profile_$layout"/trace_rank*.json; pack
      done
    elif [ "$1" = run-h ]; then
      fan_in_slice fan_in_slice
    elif [ "$1" = run-f ]; then
      ( export CUDA_VISIBLE_DEVICES=0
        NVIDIA_TF32_OVERRIDE=0 timeout 120 python3 scripts/gpu/check_grouped_lora.py > "$WORK/grouped_lora.txt" 2>&1
        echo "check_grouped_lora exit $?"; tail -4 "$WORK/grouped_lora.txt"
        MIMO_SLOW_START_S=0 layouts lora_full 8 ${FULL_TIMEOUT:-420} full-lora16 ) > "$WORK/gpu0.txt" 2>&1 &
      gpu0=$!
      hetero_cp hetero_cp
      export CUDA_VISIBLE_DEVICES=1,2
      layouts ep2 12 130 colocated-dp2 colocated-ep2
      layouts cp_32k 10 150 colocated-dp2 colocated-cp2-32k -- --set images_per_sample=2 --set patches_per_image=4096
      wait $gpu0; cat "$WORK/gpu0.txt"; pack
    elif [ "$1" = run-full ]; then  # the whole model alone, each rank's stacks every 90 s and the GPUs' memory
      (while sleep 20; do nvidia-smi --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv,noheader
       done) > "$WORK/gpu_samples.csv" 2>&1 &
      sampler=$!
      MIMO_STACK_DUMP_S=90 layouts full 10 ${FULL_TIMEOUT:-380} full-ep4
      kill $sampler; pack
      layouts slice 10 140 colocated-ep4 colocated-dp4
    elif [ "$1" = run-d ]; then  # the whole model's start-up with init_threads; EP4 with and without overlap
      MIMO_STACK_DUMP_S=90 MIMO_SLOW_START_S=0 layouts full 8 ${FULL_TIMEOUT:-300} full-ep4
      layouts slice 10 140 colocated-ep4 colocated-ep4-overlap
    elif [ "$1" = run-c ]; then  # LoRA on the te backend's grouped experts; the two-image split against DP4
      NVIDIA_TF32_OVERRIDE=0 timeout 120 python3 scripts/gpu/check_grouped_lora.py > "$WORK/grouped_lora.txt" 2>&1
      echo "check_grouped_lora exit $?"; tail -8 "$WORK/grouped_lora.txt"; pack
      layouts two_images 10 150 colocated-dp4 split-2+2-ep2 -- --set images_per_sample=2 --set patches_per_image=4096
    elif [ "$1" = run-a ]; then
      optimizer_precision optimizer_precision
      layouts full 10 280 full-ep4
      layouts slice 12 150 colocated-dp4 colocated-ep4
    else
      layouts two_images 14 160 colocated-dp4 split-2+2-ep2 -- --set images_per_sample=2 --set patches_per_image=4096
      layouts slice_b 14 150 colocated-dp4 split-1+3
    fi
    ;;
  *) echo "usage: four_gpus.sh prepare | install | run-a | ... | run-h | run-full"; exit 2 ;;
esac
