#!/usr/bin/env bash
# Decoding on one GPU: the graphed one-token step against the sync-free step and transformers' `generate` in one
# process (bench/generate.py, nemotron-moe-vlm-mid in bf16), then the tiny model's te backend decoding the same
# tokens on every way of stepping (tests/decode_worker.py). Run from the repository root, two device calls in a row
# (a machine stays warm 30 s after a call; a later call on a fresh machine stops at once with exit 3):
#   1  carry [".whl-te"]  timeout_s 120   bash scripts/gpu/issue31.sh install
#   2  carry [".whl"]     timeout_s 600   bash scripts/gpu/issue31.sh decode
# Before them, here: bash ../shared/gpu/carry-te.sh; bash ../shared/gpu/carry.sh (with the transformers wheel the
# bench needs, and mimo's wheel rebuilt from this tree). Results: $OUT/decode.tgz (console, records), rewritten after
# each part. ISSUE31_STEPS overrides the ways of stepping the bench measures (default "sync-free graph");
# ISSUE31_REPEATS (3) and ISSUE31_BENCH_ARGS (e.g. --compare-logits) go to the bench; ISSUE31_WORKER=0 leaves the
# tiny model's check out.
set -uo pipefail
export PYTHONUNBUFFERED=1
phase=${1:?install or decode}
R=/tmp/i31/$phase
mkdir -p "$R"
pack() { tar czf "$OUT/$phase.tgz" -C /tmp/i31 "$phase" 2>/dev/null; true; }

case "$phase" in
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/te-site .whl-te/*.whl \
      && touch /tmp/te-site/ok || exit 3
    ;;
  decode)
    test -f /tmp/te-site/ok || { echo "TE stack missing: the machine is new; repeat the install call"; exit 3; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site:/tmp/te-site TRITON_CACHE_DIR=/tmp/i31/triton
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/versions.txt"
    started=$SECONDS
    # shellcheck disable=SC2086
    timeout -k 10 ${ISSUE31_BENCH_S:-420} python3 bench/generate.py --out "$R/gen" \
      --repeats ${ISSUE31_REPEATS:-3} --steps ${ISSUE31_STEPS:-sync-free graph} ${ISSUE31_BENCH_ARGS:-} 2>&1 | grep -v '^\[transformers\]' | tee "$R/bench.log"
    echo "== bench: exit ${PIPESTATUS[0]}, $(( SECONDS - started )) s"
    pack
    [ "${ISSUE31_WORKER:-1}" = 0 ] && exit 0
    started=$SECONDS
    MIMO_DECODE_DEVICE=cuda MIMO_DECODE_STEPS=graph timeout -k 10 $(( 560 - SECONDS )) \
      python3 tests/decode_worker.py nemotron-moe-vlm-tiny backend=te seq_length=256 > "$R/worker.jsonl" \
      2> "$R/worker.err"
    echo "== worker: exit $?, $(( SECONDS - started )) s"
    python3 - "$R/worker.jsonl" <<'EOF'
import json, sys
for r in map(json.loads, filter(str.strip, open(sys.argv[1]))):
    same = r["device"] == r["cached"] == r["plain"] and r["device_stopped"] == r["plain_stopped"]
    print(f"{r['prompt']}: {r['prompt_tokens']} prompt tokens, steps {r['steps']} (default {r['default_steps']}), "
          f"graph == sync-free == waiting: {same}, cached == recomputed: {r['cached'] == r['recomputed']}")
EOF
    tail -3 "$R/worker.err"
    pack
    ;;
esac
