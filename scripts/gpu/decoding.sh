#!/usr/bin/env bash
# Decoding on one H100: `mimo generate`'s graphed one-token step against its eager steps and transformers'
# `generate`, one process (bench/generate.py, nemotron-moe-vlm-mid in bf16; docs/benchmarks.md (h)), then the tiny
# model's te backend decoding the same tokens every way of stepping (tests/decode_worker.py). From the repository
# root (the bench needs a transformers with the Nemotron omni model; the record names the version it ran with):
#   here, once:                                  bash scripts/gpu/decoding.sh prepare
#   device call 1, carry [".whl-te"], 120 s:     bash scripts/gpu/decoding.sh install
#   device call 2, carry [".whl"], 600 s:        bash scripts/gpu/decoding.sh run
# (call 2 right after call 1: scripts/gpu/common.sh). Results: $OUT/decoding.tgz (console, records), rewritten
# after each part. DECODING_STEPS: the ways of stepping measured (default "graph device sync-free");
# DECODING_REPEATS (3) and DECODING_ARGS (e.g. --compare-logits) go to the bench; DECODING_WORKER=0 leaves the
# tiny model's check out. Qwen3.5-VL: DECODING_ARGS="--family qwen --compare-logits" DECODING_WORKER=0 (transformers
# needs its qwen3_5_moe model: the record names the version).
set -uo pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/common.sh"
R=/tmp/mimo-gpu/decoding
pack() { tar czf "$OUT/decoding.tgz" -C /tmp/mimo-gpu decoding 2>/dev/null; true; }

case "${1:-}" in
  prepare) prepare ;;
  install) install_te ;;
  run)
    use_wheels te
    mkdir -p "$R"
    export TRITON_CACHE_DIR=/tmp/mimo-gpu/triton
    versions "$R/versions.txt"
    started=$SECONDS
    # shellcheck disable=SC2086
    timeout -k 10 "${DECODING_BENCH_S:-420}" python3 bench/generate.py --out "$R/gen" \
      --repeats "${DECODING_REPEATS:-3}" --steps ${DECODING_STEPS:-graph device sync-free} ${DECODING_ARGS:-} 2>&1 \
      | grep -v '^\[transformers\]' | tee "$R/bench.log"
    echo "== bench: exit ${PIPESTATUS[0]}, $(( SECONDS - started )) s"
    pack
    [ "${DECODING_WORKER:-1}" = 0 ] && exit 0
    started=$SECONDS
    MIMO_DECODE_DEVICE=cuda MIMO_DECODE_STEPS=graph timeout -k 10 $(( 560 - SECONDS )) \
      python3 tests/decode_worker.py nemotron-moe-vlm-tiny backend=te seq_length=256 > "$R/worker.jsonl" \
      2> "$R/worker.err"
    echo "== worker: exit $?, $(( SECONDS - started )) s"
    python3 - "$R/worker.jsonl" <<'PY'
import json, sys
for r in map(json.loads, filter(str.strip, open(sys.argv[1]))):
    same = r["device"] == r["cached"] == r["plain"] and r["device_stopped"] == r["plain_stopped"]
    print(f"{r['prompt']}: {r['prompt_tokens']} prompt tokens, steps {r['steps']} (default {r['default_steps']}), "
          f"graph == sync-free == waiting: {same}, cached == recomputed: {r['cached'] == r['recomputed']}")
PY
    tail -3 "$R/worker.err"
    pack
    ;;
  *) echo "usage: decoding.sh prepare | install | run"; exit 2 ;;
esac
