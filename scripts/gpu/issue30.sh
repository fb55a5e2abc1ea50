#!/usr/bin/env bash
# The Nemotron slice on one H100: time to the first iteration (fresh and warm caches, pinned autotuning) and steady
# speed, each against main at 08bb8c9 in the same call; the dense mock-vlm against main; nemotron-moe-vlm-mid's
# recipes with diagnostics; FP8. Run from the repository root, three device calls in a row (a machine stays warm
# 30 s after a call: send the next one at once; a later call on a fresh machine stops at once with exit 3):
#   1  carry [".whl-te"]  timeout_s 420   bash scripts/gpu/issue30.sh install
#   2  carry [".whl"]     timeout_s 600   bash scripts/gpu/issue30.sh slice
#   3  carry [".whl"]     timeout_s 600   bash scripts/gpu/issue30.sh rest
# (later sessions: round2 .. round45 in place of slice/rest, each after an install call; round6-25 and 27 need
# no main; the later rounds name the commit they need in bench_baseline: round37 5c2c3c7, round38 c88aa2f,
# round39 4f26129, round40 and round41 (after round40, same machine) eede709,
# round43, round44 (after round43, same machine) and round45 550576f, round46 1f7ac12, round47 to round50
# e1396d0, round51 and round52 (after round51, same machine), round53 and round54 52eb563; the install call's Mamba probe takes its chunk lengths from ISSUE30_PROBE_CHUNKS, default "128 256")
# Before them, here: bash ../shared/gpu/carry-te.sh; bash ../shared/gpu/carry.sh; and main's code, untracked and
# not ignored so that it travels (do not commit it):
#   mkdir -p bench_baseline && git archive 08bb8c9 --prefix=mimo/ | tar -x -C bench_baseline
# Results: $OUT/<phase>.tgz (logs, metrics, records, profile summaries, the recorded kernel_configs.json), rewritten
# after every run so that a call stopped early keeps what finished; the summary table is the last output.
set -uo pipefail
export PYTHONUNBUFFERED=1
phase=${1:?install, slice or rest}
# seconds the phase may use: timeout_s (420 for install, 600 for the others) less a margin for the transfers
LIMIT=${ISSUE30_LIMIT:-$([ "$phase" = install ] && echo 370 || echo 540)}
R=/tmp/i30/$phase
mkdir -p "$R"
base="$PWD/bench_baseline"
pack() { tar czf "$OUT/$phase.tgz" --exclude='trace_*' -C /tmp/i30 "$phase" 2>/dev/null; true; }
left() { echo $(( LIMIT - SECONDS )); }
# bench DIR CAP ARGS...: one bench/te_path.py call, stopped after CAP seconds or at the phase's limit
bench() {
  local dir=$1 cap=$2; shift 2
  local rest=$(( $(left) - 5 ))
  (( cap > rest )) && cap=$rest
  if (( cap < 60 )); then echo "== $dir skipped: $(left) s of the phase left"; return 1; fi
  timeout -k 10 "$cap" python3 bench/te_path.py --out "$R/$dir" --timeout $(( cap - 20 )) "$@" 2>&1 \
    | tee -a "$R/console.log"
  pack
}
ok() { grep -q '"status": "ok"' "$R/$1/te_path.json" 2>/dev/null; }
first_done() { grep -q '"first_iteration_s"' "$R/$1/te_path.json" 2>/dev/null; }

versions() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton, transformer_engine as te, mamba_ssm; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformer_engine', te.__version__, 'mamba_ssm', mamba_ssm.__version__, \
torch.cuda.get_device_name())"
}

# ready: the machine has the TE stack of the install call, this call's wheels and main's code (else exit 3)
ready() {
  test -f /tmp/te-site/ok || { echo "TE stack missing: the machine is new; repeat the install call"; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:/tmp/te-site
  [ "${1:-}" = without-main ] || test -f "$base/mimo/__init__.py" \
    || { echo "bench_baseline/mimo missing (git archive, see the header)"; exit 3; }
}

# start_round CACHE ITERATIONS: ready, the versions noted, the round's own kernel cache, W for te_path (12 of
# warm-up)
start_round() {
  ready
  versions > "$R/versions.txt" 2>&1
  export MIMO_COMPILE_CACHE=$1
  W="--iterations $2 --warmup 12"
}

# this_code_then_main ITERATIONS CAP: on a fresh machine, this code first (its first iteration on the empty cache,
# at most CAP seconds), then main for what the phase has left
this_code_then_main() {
  start_round /tmp/ccK "$1"
  slice sn "$2"; slice sb rest base
}

# slice RUN CAP|rest [base] [te_path options...]: one slice-te-graphs run of the round (W from start_round) with
# this checkout's code, or main's with "base"; "rest": what the phase has left
slice() {
  local run=$1 cap=$2; shift 2
  [ "$cap" = rest ] && cap=$(( $(left) - 10 ))
  if [ "${1:-}" = base ]; then shift; set -- --baseline-src "$base" "$@"; fi
  bench "$run" "$cap" --cases slice-te-graphs $W "$@"
}

case "$phase" in
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/te-site .whl-te/*.whl \
      && touch /tmp/te-site/ok || exit 3
    export PYTHONPATH=/tmp/te-site
    versions 2>&1 | tee "$R/versions.txt"
    # mamba-ssm's share of the first iteration (compile + autotune of the training kernel megatron-core calls) and
    # its speed at chunk 128 (megatron's) and 256, at the slice's shape (ISSUE30_PROBE_SHAPES="slice mid" adds
    # mid's); a cache of its own, so that call 2 starts cold
    [ "${ISSUE30_PROBE:-1}" = 0 ] || TRITON_CACHE_DIR=/tmp/triton-probe timeout -k 10 $(( $(left) - 10 )) \
      python3 scripts/gpu/mamba_ssd_probe.py --shapes ${ISSUE30_PROBE_SHAPES:-slice} \
      --chunks ${ISSUE30_PROBE_CHUNKS:-128 256} --out "$R/mamba_probe.json" 2>&1 | tee "$R/probe.log"
    pack
    ;;
  slice|rest)
    ready
    versions > "$R/versions.txt" 2>&1
    if [ "$phase" = slice ]; then
      # 1 empty caches, every kernel autotuned (no pins), torch.compile off: writes /tmp/ccA/kernel_configs.json
      bench 1 200 --cases slice-te --extra "--compile-cache /tmp/ccA --kernel-configs none"
      # a failure of the transformer-engine additions must not cost the call: again with MIMO_TE_EXTRAS=0
      ok 1 || MIMO_TE_EXTRAS=0 bench 1b 180 --cases slice-te --extra "--compile-cache /tmp/ccA --kernel-configs none"
      # 2 empty caches plus the pins of 1: a fresh machine's first iteration; CUDA graphs (mamba, attn) from
      # iteration 2; one profiled iteration
      bench 2 170 --cases slice-te-graphs --iterations 12 --profile slice-te-graphs \
        --extra "--compile-cache /tmp/ccB --kernel-configs /tmp/ccA/kernel_configs.json"
      # graphs refused before iteration 1 (cache B still empty): the pinned fresh start without them
      first_done 2 || bench 2b 150 --cases slice-te \
        --extra "--compile-cache /tmp/ccB --kernel-configs /tmp/ccA/kernel_configs.json"
      # 3 main (08bb8c9) on cache A's kernels and autotune timings, same card, same call
      TRITON_CACHE_DIR=/tmp/ccA/triton TRITON_CACHE_AUTOTUNING=1 bench 3 140 --cases slice-te --baseline-src "$base"
      cp /tmp/ccA/kernel_configs.json "$R/kernel_configs_A.json" 2>/dev/null
      cp /tmp/ccB/kernel_configs.json "$R/kernel_configs_B.json" 2>/dev/null
      pack
    else
      test -d /tmp/ccB || { echo "the caches of call 2 are missing: the machine is new"; exit 3; }
      # 4 warm caches: a second run's first iteration, and slice-te measured again (run-to-run spread against 1)
      bench 4 100 --cases slice-te --extra "--compile-cache /tmp/ccB"
      # 7 mid: the docs' best recipe under the default memory check with average images (the recipe that was
      # stuck in iteration 1); stacks every 45 s during iterations 1-2, allocator retries in the records
      MIMO_STACK_DUMP_S=45 bench 7 170 --cases mid-te-mbs8-selective --timeout 150 \
        --extra "--compile-cache /tmp/ccB --image-patches mean"
      # 5, 6 the dense mock-vlm's best recipe, this checkout against main
      bench 5 80 --cases dense-te-graphs-fp8-mbs4 --extra "--compile-cache /tmp/ccB"
      bench 6 90 --cases dense-te-graphs-fp8-mbs4 --baseline-src "$base"
      # 8 FP8 tensorwise with graphs of the Mamba layers, if the call has time left
      bench 8 110 --cases slice-te-fp8 --extra "--compile-cache /tmp/ccB"
      # 9 mid's default recipe on main, if the call has time left
      TRITON_CACHE_DIR=/tmp/ccB/triton bench 9 80 --cases mid-te --baseline-src "$base"
    fi
    python3 bench/te_path.py --summarize "$R"   # one table of every run, last in the output
    ;;
  round2|round3)
    # The second device session (after the first found the transformer-engine additions stuck in iteration 1):
    # round2 finds where they stop, then measures the slice without them (fresh unpinned, fresh pinned, main);
    # round3 the warm start, mid's stuck recipe and decoding against transformers (bench/generate.py).
    ready
    if [ "$phase" = round2 ]; then
      MIMO_STACK_DUMP_S=30 bench d 120 --cases slice-te --extra "--compile-cache /tmp/ccA --kernel-configs none"
      MIMO_TE_EXTRAS=0 bench f 130 --cases slice-te --extra "--compile-cache /tmp/ccB --kernel-configs none"
      MIMO_TE_EXTRAS=0 bench p 120 --cases slice-te \
        --extra "--compile-cache /tmp/ccC --kernel-configs /tmp/ccB/kernel_configs.json"
      TRITON_CACHE_DIR=/tmp/ccB/triton TRITON_CACHE_AUTOTUNING=1 bench b 140 --cases slice-te --baseline-src "$base"
      cp /tmp/ccB/kernel_configs.json "$R/kernel_configs_B.json" 2>/dev/null; pack
    else
      test -d /tmp/ccB || { echo "the caches of round2 are missing: the machine is new"; exit 3; }
      MIMO_TE_EXTRAS=0 bench w 100 --cases slice-te --extra "--compile-cache /tmp/ccB"
      MIMO_TE_EXTRAS=0 MIMO_STACK_DUMP_S=45 bench m 150 --cases mid-te-mbs8-selective --timeout 130 \
        --extra "--compile-cache /tmp/ccB --image-patches mean"
      g=$(( $(left) - 15 ))
      (( g > 90 )) && TRITON_CACHE_DIR=/tmp/ccB/triton timeout -k 10 $g python3 bench/generate.py --out "$R/gen" \
        --repeats 3 2>&1 | tail -40 | tee -a "$R/console.log"
      pack
    fi
    ;;
  round4|round5)
    # The third device session: the provider's recorded pins (kernel_configs/sm90.json, from the first session's
    # slice run) on a fresh cache, the warm start, main in the same call (round4); decoding against transformers
    # and mid's stuck recipe (round5).
    ready
    if [ "$phase" = round4 ]; then
      bench f 215 --cases slice-te --extra "--compile-cache /tmp/ccD"
      bench w 120 --cases slice-te --extra "--compile-cache /tmp/ccD"
      TRITON_CACHE_DIR=/tmp/ccD/triton TRITON_CACHE_AUTOTUNING=1 bench b 190 --cases slice-te --baseline-src "$base"
    else
      test -d /tmp/ccD || { echo "the caches of round4 are missing: the machine is new"; exit 3; }
      TRITON_CACHE_DIR=/tmp/ccD/triton timeout -k 10 300 python3 bench/generate.py --out "$R/gen" --repeats 3 2>&1 \
        | tail -40 | tee -a "$R/console.log"; pack
      MIMO_STACK_DUMP_S=60 bench m $(( $(left) - 10 )) --cases mid-te-mbs8-selective \
        --extra "--compile-cache /tmp/ccD --image-patches mean"
    fi
    ;;
  round6)
    # The fourth device session: the slice with CUDA graphs (Mamba and attention layers), and with FP8 tensorwise
    # (graphed Mamba layers), each beside the plain slice in the same call, one cache for all three (no main).
    ready without-main
    versions > "$R/versions.txt" 2>&1
    bench p 190 --cases slice-te --extra "--compile-cache /tmp/ccE"
    bench g 170 --cases slice-te-graphs --extra "--compile-cache /tmp/ccE"
    bench 8 $(( $(left) - 10 )) --cases slice-te-fp8 --extra "--compile-cache /tmp/ccE"
    ;;
  round7)
    # After round6 found FP8 failing in iteration 1's backward (the in-place padded routing map, now with the
    # unfused router): FP8 tensorwise with graphed Mamba layers, then the bf16 graphs recipe again in the same call.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    bench 8 170 --cases slice-te-fp8 --extra "--compile-cache /tmp/ccF"
    bench g $(( $(left) - 10 )) --cases slice-te-graphs --extra "--compile-cache /tmp/ccF"
    ;;
  round8)
    # The fifth device session: the encoders once per step (--encoder-pass step) against once per micro-batch, on
    # the slice with graphs, one cache for all (the first run fills it: its first iteration is a fresh machine's);
    # the step recipe with RADIO recomputed (fits the default memory check) profiled; then FP8 and the dense model.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    bench b 170 --cases slice-te-graphs --extra "--compile-cache /tmp/ccG --encoder-pass micro-batch"
    bench s 150 --cases slice-te-graphs --iterations 12 --profile slice-te-graphs \
      --extra "--compile-cache /tmp/ccG --encoder-pass step --recompute images=full"
    bench m 110 --cases slice-te-graphs --extra "--compile-cache /tmp/ccG --encoder-pass step --image-patches mean"
    bench f 110 --cases slice-te-fp8 --extra "--compile-cache /tmp/ccG --encoder-pass step --recompute images=full"
    bench d 80 --cases dense-te-graphs-fp8-mbs4 --extra "--compile-cache /tmp/ccG --encoder-pass micro-batch"
    bench e $(( $(left) - 10 )) --cases dense-te-graphs-fp8-mbs4 --extra "--compile-cache /tmp/ccG --encoder-pass step"
    ;;
  round9|round10|round11)
    # The fifth device session, after round8: the routed experts as torch grouped GEMMs with the token counts on
    # the GPU (expert_gemm auto) against transformer-engine's grouped GEMM (expert_gemm=megatron), each in one call:
    # the slice's step recipes (round9); the slice with every default and nemotron-moe-vlm-mid's default recipe
    # against main's choices (round10); mid's micro-batch-8 recipe both ways (round11). Install with ISSUE30_PROBE=0.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    if [ "$phase" = round9 ]; then
      E="--compile-cache /tmp/ccH --encoder-pass step --image-patches mean"
      bench b 170 --cases slice-te-graphs --extra "$E --set expert_gemm=megatron"
      bench g 130 --cases slice-te-graphs --iterations 12 --profile slice-te-graphs --extra "$E"
      bench r 110 --cases slice-te-graphs --extra "--compile-cache /tmp/ccH --encoder-pass step --recompute images=full"
      bench f $(( $(left) - 10 )) --cases slice-te-fp8 --extra "$E"
    elif [ "$phase" = round10 ]; then
      bench a 150 --cases slice-te-graphs --iterations 12 --profile slice-te-graphs --extra "--compile-cache /tmp/ccI"
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench x 100 --cases slice-te-graphs \
        --extra "--compile-cache /tmp/ccI"
      bench b 130 --cases mid-te --extra "--compile-cache /tmp/ccI --set expert_gemm=megatron --encoder-pass micro-batch"
      bench g $(( $(left) - 10 )) --cases mid-te --extra "--compile-cache /tmp/ccI"
    else
      bench s 200 --cases mid-te-mbs8-selective --extra "--compile-cache /tmp/ccJ --image-patches mean"
      bench t $(( $(left) - 10 )) --cases mid-te-mbs8-selective \
        --extra "--compile-cache /tmp/ccJ --image-patches mean --set expert_gemm=megatron"
    fi
    ;;
  round12)
    # Where the slice's GPU still waits with every default (step encoders recomputed, grouped-GEMM experts), and
    # with the encoders' activations kept (images at their mean size): each profiled, the idle time by host
    # operation in the summaries.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    bench a 170 --cases slice-te-graphs --iterations 12 --profile slice-te-graphs --extra "--compile-cache /tmp/ccK"
    bench m $(( $(left) - 10 )) --cases slice-te-graphs --iterations 12 --profile slice-te-graphs \
      --extra "--compile-cache /tmp/ccK --encoder-pass step --image-patches mean"
    ;;
  round13)
    # The slice and mid with every default, profiled: the summaries name each host synchronization's call site.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    bench a 170 --cases slice-te-graphs --iterations 12 --profile slice-te-graphs --extra "--compile-cache /tmp/ccL"
    bench m $(( $(left) - 10 )) --cases mid-te --iterations 12 --profile mid-te --extra "--compile-cache /tmp/ccL"
    ;;
  round14)
    # nemotron-moe-vlm-mid with CUDA graphs of its Mamba and attention layers, at micro-batch 4 x 2 and 8 x 1.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    bench g 170 --cases mid-te-graphs --extra "--compile-cache /tmp/ccM"
    bench s $(( $(left) - 10 )) --cases mid-te-mbs8-selective-graphs --extra "--compile-cache /tmp/ccM --image-patches mean"
    ;;
  round15)
    # The closing record: main's choices (per-micro-batch encoders, transformer-engine's grouped GEMM) against every
    # default of this work, the slice and mid with CUDA graphs, one machine, one call, one cache.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    M="--encoder-pass micro-batch --set expert_gemm=megatron"
    bench sb 150 --cases slice-te-graphs --extra "--compile-cache /tmp/ccN $M"
    bench sd 110 --cases slice-te-graphs --extra "--compile-cache /tmp/ccN"
    bench mb 130 --cases mid-te-graphs --extra "--compile-cache /tmp/ccN $M"
    bench md $(( $(left) - 10 )) --cases mid-te-graphs --extra "--compile-cache /tmp/ccN"
    ;;
  round16)
    # RADIO's recomputed forward replayed as CUDA graphs (the vision_graphs setting): the slice without and with
    # (profiled after the first buckets), mid's default (encoders not recomputed) against images=full with graphs.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    W="--iterations 16 --warmup 6"
    bench so 130 --cases slice-te-graphs $W --extra "--compile-cache /tmp/ccP --set vision_graphs=false"
    bench sg 130 --cases slice-te-graphs $W --profile slice-te-graphs --extra "--compile-cache /tmp/ccP"
    bench md 110 --cases mid-te-graphs $W --extra "--compile-cache /tmp/ccP"
    bench mg $(( $(left) - 10 )) --cases mid-te-graphs $W --extra "--compile-cache /tmp/ccP --recompute images=full"
    ;;
  round17)
    # round16 again over 40 iterations (20 left out): every bucket of patch counts is captured in the first ones
    ready without-main
    versions > "$R/versions.txt" 2>&1
    W="--iterations 40 --warmup 20"
    bench so 150 --cases slice-te-graphs $W --extra "--compile-cache /tmp/ccQ --set vision_graphs=false"
    bench sg 150 --cases slice-te-graphs $W --profile slice-te-graphs --extra "--compile-cache /tmp/ccQ"
    bench mg 100 --cases mid-te-graphs $W --extra "--compile-cache /tmp/ccQ --recompute images=full"
    bench md $(( $(left) - 10 )) --cases mid-te-graphs $W --extra "--compile-cache /tmp/ccQ"
    ;;
  round18)
    # Why round17's mid with images=full and graphed recompute did not finish its first iteration: four
    # iterations, every thread's stack printed (faulthandler) if the worker is still there after 100 s; then the
    # slice with the encoder recomputed (this GPU fits it without: say so), megatron-core's recompute against graphs.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    mkdir -p "$R/diag"
    ( sleep 100; pkill -ABRT -f "multiprocessing.spawn" ) &
    killer=$!
    PYTHONFAULTHANDLER=1 timeout -k 10 130 python3 -m mimo.cli run --provider nemotron-moe-vlm-mid --set backend=te --precision bf16 \
      --device cuda --micro-batch-size 4 --num-microbatches 2 --train-iters 4 --log-interval 1 --cuda-graphs \
      --compile-cache /tmp/ccR --recompute images=full > "$R/diag/mid.log" 2>&1
    echo "diag rc $?" | tee -a "$R/diag/mid.log"
    kill $killer 2>/dev/null
    grep -v "^ *File\|^  " "$R/diag/mid.log" | tail -5
    pack
    W="--iterations 24 --warmup 12 --extra"
    bench so 150 --cases slice-te-graphs $W "--compile-cache /tmp/ccR --recompute images=full --set vision_graphs=false"
    bench sg $(( $(left) - 10 )) --cases slice-te-graphs $W "--compile-cache /tmp/ccR --recompute images=full"
    ;;
  round19)
    # The slice with every default (on an H100 the encoders are recomputed, so their forward replays graphs) against
    # vision_graphs=false (megatron-core's recompute), 28 iterations, 14 left out; the graphed one profiled late.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    W="--iterations 28 --warmup 14"
    bench so 170 --cases slice-te-graphs $W --extra "--compile-cache /tmp/ccS --set vision_graphs=false"
    bench sg $(( $(left) - 10 )) --cases slice-te-graphs $W --profile slice-te-graphs --extra "--compile-cache /tmp/ccS"
    grep -h "recomputed layers" "$R"/sg/*.log
    ;;
  round20)
    # A launch queue four times CUDA's default (CUDA_SCALE_LAUNCH_QUEUES=4x): the host runs further ahead in the
    # GPU-bound LLM phases, hiding the encoders' host-bound backward. The slice with every default, without and with.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    W="--iterations 24 --warmup 12"
    bench sg 160 --cases slice-te-graphs $W --extra "--compile-cache /tmp/ccT"
    export CUDA_SCALE_LAUNCH_QUEUES=4x
    bench sq 120 --cases slice-te-graphs $W --profile slice-te-graphs --extra "--compile-cache /tmp/ccT"
    bench mq $(( $(left) - 10 )) --cases mid-te-graphs $W --extra "--compile-cache /tmp/ccT"
    ;;
  round21)
    # The closing record on an H100: the slice with every default, the same with --fp8 tensorwise, and mid's
    # default recipe (4 x 2 with graphs), one call, one cache.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    W="--iterations 24 --warmup 12"
    bench sg 160 --cases slice-te-graphs $W --extra "--compile-cache /tmp/ccU"
    bench sf 140 --cases slice-te-fp8 $W --extra "--compile-cache /tmp/ccU"
    bench md $(( $(left) - 10 )) --cases mid-te-graphs $W --extra "--compile-cache /tmp/ccU"
    ;;
  round22)
    # The recomputed encoder's backward replayed as graphs too (vision_graphs=on, the new default) against the
    # forward only and megatron-core's recompute, the slice with every other default, one H100, one cache.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    W="--iterations 24 --warmup 12"
    bench so 160 --cases slice-te-graphs $W --extra "--compile-cache /tmp/ccV --set vision_graphs=off"
    bench sf 120 --cases slice-te-graphs $W --extra "--compile-cache /tmp/ccV --set vision_graphs=forward"
    bench sb $(( $(left) - 10 )) --cases slice-te-graphs $W --profile slice-te-graphs --extra "--compile-cache /tmp/ccV"
    grep -h "recomputed layers\|CUDA graphs" "$R"/sb/*.log | head -12
    ;;
  round23)
    # round22 again with the buckets tight (one padding sequence, the longest image rounded to 1024): the forward
    # graphed (the default) against forward and backward graphed, 40 iterations each, 20 left out.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    W="--iterations 40 --warmup 20"
    bench sf 175 --cases slice-te-graphs $W --extra "--compile-cache /tmp/ccW"
    bench sb $(( $(left) - 10 )) --cases slice-te-graphs $W --extra "--compile-cache /tmp/ccW --set vision_graphs=all"
    grep -h "recomputed layers" "$R"/s?/*.log | tail -4
    ;;
  round24)
    # The closing comparison on one H100: megatron-core's recompute against the graphed forward (the default, tight
    # buckets), 28 iterations each, 14 left out (ISSUE30_LIMIT=200: the session's last device time).
    ready without-main
    versions > "$R/versions.txt" 2>&1
    W="--iterations 28 --warmup 14"
    bench so 115 --cases slice-te-graphs $W --extra "--compile-cache /tmp/ccX --set vision_graphs=megatron"
    bench sf $(( $(left) - 10 )) --cases slice-te-graphs $W --extra "--compile-cache /tmp/ccX"
    ;;
  round25)
    # The MoE layers' router and dispatch preprocessing captured too (--cuda-graph-modules mamba,attn,moe_router:
    # with the routed token counts on the device nothing in them waits for the host), the slice and mid, each
    # against its default in the same call, one H100, one cache.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    W="--iterations 24 --warmup 12"
    bench sg 150 --cases slice-te-graphs $W --extra "--compile-cache /tmp/ccY"
    bench sr 110 --cases slice-te-graphs $W --extra "--compile-cache /tmp/ccY --cuda-graph-modules mamba,attn,moe_router"
    bench md 100 --cases mid-te-graphs $W --extra "--compile-cache /tmp/ccY"
    bench mr $(( $(left) - 10 )) --cases mid-te-graphs $W --extra "--compile-cache /tmp/ccY --cuda-graph-modules mamba,attn,moe_router"
    grep -h "CUDA graph\|captur" "$R"/sr/*.log | head -6
    ;;
  round26)
    # One wait for the GPU per step (the optimizer's gradient norms; the loss totals, MoE losses, found-inf and
    # the logs' figures read there or on the host) against main at b01c73d (bench_baseline, see the header), the
    # slice and mid with every default, one H100, one kernel cache for both (MIMO_COMPILE_CACHE).
    ready
    versions > "$R/versions.txt" 2>&1
    export MIMO_COMPILE_CACHE=/tmp/ccZ
    W="--iterations 24 --warmup 12"
    bench sb 150 --cases slice-te-graphs $W --baseline-src "$base"
    bench sn 130 --cases slice-te-graphs $W --profile slice-te-graphs
    bench mb 110 --cases mid-te-graphs $W --baseline-src "$base"
    bench mn $(( $(left) - 10 )) --cases mid-te-graphs $W
    ;;
  round27)
    # The closing record with one wait per step: the slice with every default (40 iterations, 20 left out), the
    # same with --fp8 tensorwise, mid with every default and with its MoE routers graphed too
    # (--cuda-graph-modules mamba,attn,moe_router), one H100, one cache.
    ready without-main
    versions > "$R/versions.txt" 2>&1
    export MIMO_COMPILE_CACHE=/tmp/ccQ
    bench sg 170 --cases slice-te-graphs --iterations 40 --warmup 20
    bench md 110 --cases mid-te-graphs --iterations 24 --warmup 12
    bench mr 80 --cases mid-te-graphs --iterations 24 --warmup 12 --extra "--cuda-graph-modules mamba,attn,moe_router"
    bench sf $(( $(left) - 10 )) --cases slice-te-fp8 --iterations 24 --warmup 12
    ;;
  round28)
    # round26 in the other order (the second mid run of a call was the faster one in round26 and round27, whatever
    # its code): this code first, then main at b01c73d, mid then the slice, one H100, one cache.
    ready
    versions > "$R/versions.txt" 2>&1
    export MIMO_COMPILE_CACHE=/tmp/ccR
    W="--iterations 24 --warmup 12"
    bench mn 110 --cases mid-te-graphs $W
    bench mb 90 --cases mid-te-graphs $W --baseline-src "$base"
    bench sn 135 --cases slice-te-graphs $W
    bench sb $(( $(left) - 10 )) --cases slice-te-graphs $W --baseline-src "$base"
    ;;
  round29)
    # mid alone, in the order this code, main at b01c73d, this code with the MoE routers graphed too, this code
    # again (an order effect shows as a difference between the first and the fourth), 32 iterations, 12 left out.
    ready
    versions > "$R/versions.txt" 2>&1
    export MIMO_COMPILE_CACHE=/tmp/ccS
    W="--iterations 32 --warmup 12"
    bench m1 130 --cases mid-te-graphs $W
    bench m2 90 --cases mid-te-graphs $W --baseline-src "$base"
    bench m3 90 --cases mid-te-graphs $W --extra "--cuda-graph-modules mamba,attn,moe_router"
    bench m4 90 --cases mid-te-graphs $W
    bench m5 $(( $(left) - 10 )) --cases mid-te-graphs $W --baseline-src "$base"
    ;;
  round30)
    # The closing record: every default (one wait per step, the MoE routers graphed) against main at b01c73d, the
    # slice (40 iterations, 20 left out) and mid (main, this code, main again: 32 iterations, 12 left out), one H100,
    # one cache.
    ready
    versions > "$R/versions.txt" 2>&1
    export MIMO_COMPILE_CACHE=/tmp/ccT
    W="--iterations 40 --warmup 20"
    bench sb 150 --cases slice-te-graphs $W --baseline-src "$base"
    bench sn 115 --cases slice-te-graphs $W
    W="--iterations 32 --warmup 12"
    bench mb 100 --cases mid-te-graphs $W --baseline-src "$base"
    bench mn 80 --cases mid-te-graphs $W
    bench mc $(( $(left) - 10 )) --cases mid-te-graphs $W --baseline-src "$base"
    ;;
  round31)
    # round30 again after its failure (the provider then asked for moe_preprocess too, which breaks megatron-core's
    # shared-expert overlap in iteration 2): the MoE routers alone, as round25 and round29 measured them; the
    # session's last device time (ISSUE30_LIMIT=480).
    ready
    versions > "$R/versions.txt" 2>&1
    export MIMO_COMPILE_CACHE=/tmp/ccU
    W="--iterations 40 --warmup 20"
    bench sb 140 --cases slice-te-graphs $W --baseline-src "$base"
    bench sn 110 --cases slice-te-graphs $W
    W="--iterations 32 --warmup 12"
    bench mb 100 --cases mid-te-graphs $W --baseline-src "$base"
    bench mn $(( $(left) - 10 )) --cases mid-te-graphs $W
    ;;
  round32)
    # Weight gradients into main_grad for megatron-core's own layers (the output layer, the embedding), the
    # gradient scale as one multi-tensor kernel, RADIO's THD boundaries shifted on the host: against main at
    # d3b5848 (bench_baseline), the slice with every default, then this code profiled (40 busiest kernels).
    ready
    versions > "$R/versions.txt" 2>&1
    export MIMO_COMPILE_CACHE=/tmp/ccV
    W="--iterations 24 --warmup 12"
    bench sb 150 --cases slice-te-graphs $W --baseline-src "$base"
    bench sn 120 --cases slice-te-graphs $W
    bench sp 120 --cases slice-te-graphs $W --profile slice-te-graphs
    bench sc $(( $(left) - 10 )) --cases slice-te-graphs $W --baseline-src "$base"
    ;;
  round33)
    # round32's code on mid against main at d3b5848 (main, this code, main: the first mid run on a machine is
    # slower whatever its code), the slice with --no-grad-accum-fusion (what the fused weight gradients buy on
    # their own) and with --fp8 tensorwise.
    ready
    versions > "$R/versions.txt" 2>&1
    export MIMO_COMPILE_CACHE=/tmp/ccW
    W="--iterations 24 --warmup 12"
    bench mb 120 --cases mid-te-graphs $W --baseline-src "$base"
    bench mn 80 --cases mid-te-graphs $W
    bench mc 80 --cases mid-te-graphs $W --baseline-src "$base"
    bench sf 140 --cases slice-te-fp8 $W
    bench su $(( $(left) - 10 )) --cases slice-te-graphs $W --extra "--no-grad-accum-fusion"
    ;;
  round34)
    # round33's mid rows again with caps that fit mid's start and first-iteration autotuning (round33's were
    # too short, and its first main run died at start-up with SIGSEGV before any output), then the slice
    # without fused weight gradients (round33 passed the option to te_path.py unquoted).
    ready
    versions > "$R/versions.txt" 2>&1
    export MIMO_COMPILE_CACHE=/tmp/ccX
    W="--iterations 24 --warmup 12"
    bench mb 160 --cases mid-te-graphs $W --baseline-src "$base"
    bench mn 120 --cases mid-te-graphs $W
    bench su $(( $(left) - 10 )) --cases slice-te-graphs $W --extra=--no-grad-accum-fusion
    ;;
  round35)
    # The fused squared-ReLU-times-probabilities kernels checked against the eager expression; then the slice with
    # them, the experts' weight gradients added into main_grad in one call (no hook per expert) and the step's
    # images concatenated on the GPU, against main at d3b5848 (first: it takes the empty cache), this code, main
    # again, this code profiled.
    ready
    versions > "$R/versions.txt" 2>&1
    python3 scripts/gpu/check_squared_relu_probs.py 2>&1 | tee "$R/check_squared_relu_probs.json"
    export MIMO_COMPILE_CACHE=/tmp/ccY
    W="--iterations 24 --warmup 12"
    bench sb 150 --cases slice-te-graphs $W --baseline-src "$base"
    bench sn 110 --cases slice-te-graphs $W
    bench sc 110 --cases slice-te-graphs $W --baseline-src "$base"
    bench sp $(( $(left) - 10 )) --cases slice-te-graphs $W --profile slice-te-graphs
    ;;
  round36)
    # round35's code on mid against main at d3b5848 (main first: a machine's first mid run is the slower one
    # whatever its code), then the slice with --fp8 tensorwise.
    ready
    versions > "$R/versions.txt" 2>&1
    export MIMO_COMPILE_CACHE=/tmp/ccZ
    W="--iterations 24 --warmup 12"
    bench mb 170 --cases mid-te-graphs $W --baseline-src "$base"
    bench mn 120 --cases mid-te-graphs $W
    bench sf $(( $(left) - 10 )) --cases slice-te-fp8 $W
    ;;
  round37)
    # The experts' weight gradients into main_grad: the Triton add after torch's grouped GEMM (the default) and the
    # fused grouped GEMM (MIMO_GROUPED_WGRAD=fused), checked against an fp32 reference and timed; then the slice
    # against the previous session's code (5c2c3c7 in bench_baseline; first: it takes the empty cache), this code,
    # this code with the fused GEMM (only if its check passed), with RADIO's biases in transformer-engine's GEMMs
    # (vision_bias_in_gemm), then profiled with Python stacks if time is left (the summary names where each busy
    # kernel was launched; the Chrome trace, compressed, comes back too).
    ready
    versions > "$R/versions.txt" 2>&1
    fused=1
    timeout -k 5 70 python3 scripts/gpu/check_grouped_wgrad.py 2>&1 | tee "$R/check_grouped_wgrad.json" || fused=0
    export MIMO_COMPILE_CACHE=/tmp/ccQ
    W="--iterations 24 --warmup 12"
    bench sb 150 --cases slice-te-graphs $W --baseline-src "$base"
    bench sn 110 --cases slice-te-graphs $W
    (( fused )) && MIMO_GROUPED_WGRAD=fused bench sf 105 --cases slice-te-graphs $W
    bench sg 105 --cases slice-te-graphs $W --extra "--set vision_bias_in_gemm=true"
    bench sp $(( $(left) - 15 )) --cases slice-te-graphs $W --profile slice-te-graphs --extra=--profile-with-stack
    trace=$(ls "$R"/sp/profile_*/trace_rank0.json 2>/dev/null | head -1)
    [ -n "$trace" ] && gzip -c "$trace" > "$OUT/trace37.json.gz"
    ;;
  round38)
    # Python's garbage collector: round37's iterations were slow at the same iterations in every run (the same
    # allocations, so the same collector passes). The slice against main at c88aa2f (first: it takes the empty
    # cache) with the objects of start-up frozen (this code's default), with --gc-interval 10, main again, FP8.
    start_round /tmp/ccG 36
    slice sb 150 base; slice sn 105; slice si 105 --extra "--gc-interval 10"; slice sc 100 base
    bench sf $(( $(left) - 10 )) --cases slice-te-fp8 $W
    ;;
  round39)
    # The image-grid search of the data (about 45 ms of Python per sample, in the read-ahead thread, holding the
    # interpreter's lock against the step's launches) made fast: the slice against main at 4f26129 (first: it
    # takes the empty cache), this code, both again.
    start_round /tmp/ccH 36
    slice sb 150 base; slice sn 95; slice sc 95 base; slice sm rest
    ;;
  round40)
    # RADIO's jittered position embeddings as two GEMMs (no grid_sample): the slice against main at eede709 (first:
    # it takes the empty cache), this code, main again, this code again (alternating, so that a machine's drift over
    # the call falls on both); 40 iterations, so that the window after the 12 of warm-up holds more iterations
    # without a graph capture (te_path gives the figures without them too).
    start_round /tmp/ccK 40
    slice sb 150 base; slice sn 100; slice sc 100 base; slice sn2 rest
    ;;
  round41)
    # The long window, right after round40 on the same machine (warm kernel cache): this code and main at eede709,
    # 100 iterations each, so that the steady figures cover 88 iterations and the encoder's captures thin out.
    start_round /tmp/ccK 100
    slice ln 200; slice lb rest base
    ;;
  round42)
    # CUDA_DEVICE_MAX_CONNECTIONS=32 (the reference stack's setting) against the default (8) on the slice, alternating,
    # 40 iterations each, after round41 on the same machine.
    start_round /tmp/ccK 40
    CUDA_DEVICE_MAX_CONNECTIONS=32 slice c32 120; slice c8 120
    CUDA_DEVICE_MAX_CONNECTIONS=32 slice c32b 120; slice c8b rest
    ;;
  round43)
    # The module norms copied in on the device (no wait per module before the step's one wait): main at 550576f
    # (first, empty cache) and this code, each profiled at iteration 13 (the optimizer's idle time by phase), then
    # this code with RADIO's biases in the GEMMs, main again; 50 iterations each.
    start_round /tmp/ccK 50
    slice sb 150 base --profile slice-te-graphs; slice sn 115 --profile slice-te-graphs
    slice sg 110 --extra "--set vision_bias_in_gemm=true"; slice sc rest base
    ;;
  round44)
    # After round43 on the same machine (warm cache), unprofiled: this code, main at 550576f, this code with RADIO's
    # biases in the GEMMs, this code again; 50 iterations each.
    start_round /tmp/ccK 50
    slice sn 125; slice sb 125 base; slice sg 125 --extra "--set vision_bias_in_gemm=true"; slice sn2 rest
    ;;
  round45)
    # The landed defaults (RADIO's biases in the GEMMs on, the found-inf flag by a kernel) against main at 550576f,
    # alternating, on a fresh machine (main first, on the empty cache); 45 iterations each.
    start_round /tmp/ccK 45
    slice sb 150 base; slice sn 120; slice sc 120 base; slice sn2 rest
    ;;
  round46)
    # RADIO's attention by torch's flash kernel against transformer-engine's (cuDNN): the kernels alone at RADIO's
    # shapes (scripts/gpu/check_radio_attention.py), then main at 1f7ac12 (first, empty cache), flash, te; 45
    # iterations each. Ran at ac04e32, whose Nemotron setting vision_attention=flash was removed after it (no
    # faster: docs/benchmarks.md (g)); the sf run needs that commit.
    start_round /tmp/ccK 45
    timeout -k 10 150 python3 scripts/gpu/check_radio_attention.py --out "$R/radio_attention.json" 2>&1 \
      | tee "$R/radio_attention.log"
    pack
    slice sb 150 base; slice sf 120 --extra "--set vision_attention=flash"; slice sn rest
    ;;
  round47)
    # The experts' weights in one tensor per linear (no stack copy per micro-batch) and the main weights copied into
    # the model's by one multi-tensor kernel, against main at e1396d0, alternating (main first, on the empty cache);
    # the last run profiled at iteration 13 (the optimizer's idle time by its new phases); 45 iterations each.
    start_round /tmp/ccK 45
    slice sb 150 base; slice sn 110; slice sc 110 base; slice sn2 rest --profile slice-te-graphs
    ;;
  round48)
    # On another fresh machine: main at e1396d0 (first, empty cache), this code, this code with RADIO's recompute
    # and backward graphed too (vision_graphs=all), this code with a launch queue four times CUDA's default (the
    # host further ahead when it reaches the encoders' host-bound backward); 45 iterations each.
    start_round /tmp/ccK 45
    slice sb 140 base; slice sn 105; slice sa 120 --extra "--set vision_graphs=all"
    CUDA_SCALE_LAUNCH_QUEUES=4x slice sq rest
    ;;
  round49)
    # main at e1396d0 (first, empty cache) and this code, each profiled at iteration 13 (GPU busy time, the
    # optimizer's idle by phase), then both again unprofiled; 45 iterations each.
    start_round /tmp/ccK 45
    slice sb 155 base --profile slice-te-graphs; slice sn 125 --profile slice-te-graphs
    slice sc 115 base; slice sn2 rest
    ;;
  round50)
    # 100 iterations each on a fresh machine: this code first (its first iteration on the empty cache), then main
    # at e1396d0; the long run dilutes the capture iterations of the first forty. Ran with ISSUE30_LIMIT=440 (the
    # session's device time left).
    this_code_then_main 100 225
    ;;
  round51)
    # The fused loss without the logits' copy and the LLM's gradients finalized before the encoders' backward,
    # against main at 52eb563, alternating (main first, on the empty cache); 45 iterations each.
    start_round /tmp/ccK 45
    slice sb 150 base; slice sn 120; slice sc 120 base; slice sn2 rest
    ;;
  round52)
    # After round51 on the same machine (its kernel cache): this code profiled at iteration 13, every kernel of
    # that iteration with its whole name and launch sites (kernels.txt), then main at 52eb563 and this code again.
    test -d /tmp/ccK || { echo "round51's cache is missing: the machine is new"; exit 3; }
    start_round /tmp/ccK 45
    slice sp 100 --iterations 14 --profile slice-te-graphs
    python3 scripts/gpu/trace_kernels.py "$R"/sp/profile_*/trace_rank0.json --top 80 > "$R/kernels.txt" 2>&1
    pack
    slice sb 130 base; slice sn rest
    ;;
  round53)
    # 100 iterations each on another fresh machine, as round50: this code first (its first iteration on the empty
    # cache), then main at 52eb563. Ran with ISSUE30_LIMIT=500 (the session's device time left).
    this_code_then_main 100 235
    ;;
  round54)
    # A third fresh machine, 60 iterations: this code first (its first iteration on the empty cache), then main at
    # 52eb563 for what is left. Ran with ISSUE30_LIMIT=300 (the session's device time left).
    this_code_then_main 60 170
    ;;
  *) echo "phase: install, slice, rest, round2 .. round54"; exit 2 ;;
esac
# a round ends with one table of every run it made
case "$phase" in round*) python3 bench/te_path.py --summarize "$R" ;; esac
