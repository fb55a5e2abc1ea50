#!/usr/bin/env bash
# The benchmarks of docs/benchmarks.md (a)-(d) on a GPU machine (matplotlib for plots):
#   bash scripts/gpu/benchmarks.sh one-gpu OUT    # (a) throughput and MFU, (c) loop overhead
#   bash scripts/gpu/benchmarks.sh two-gpu OUT    # (b) heterogeneous vs colocated, (d) checkpoint save/load
#   bash scripts/gpu/benchmarks.sh loop-overhead OUT   # (c) alone, as docs/benchmarks.md ran it
# On a fresh machine one device call does it: fill .whl here (`bash scripts/gpu/benchmarks.sh prepare`), then
# carry [".whl"]: `bash scripts/gpu/benchmarks.sh one-gpu $OUT/results` installs them first (no transformer-engine
# needed); without a .whl folder mimo and megatron-core must be installed already.
# CKPT_DIR (default /tmp/mimo-bench-ckpt) holds the checkpoints of (d): tens of GB, outside OUT.
set -uo pipefail
source "$(dirname "$0")/common.sh"
what=${1:?prepare, one-gpu, two-gpu or loop-overhead}
if [ "$what" = prepare ]; then bash "$CARRY_DIR/carry.sh"; exit; fi
[ -d .whl ] && use_wheels
out=${2:-results}
mkdir -p "$out"
# BENCH_ARCHIVE=FILE: also pack the results (not the traces) into one archive after each benchmark.
pack() { [ -n "${BENCH_ARCHIVE:-}" ] && tar czf "$BENCH_ARCHIVE" --exclude='trace_*' -C "$out" . ; true; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpus.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpus.txt"
case "$what" in
  one-gpu)
    python3 bench/throughput.py --out "$out/throughput" ${THROUGHPUT_CASES:+--cases $THROUGHPUT_CASES}; pack
    python3 bench/loop_overhead.py --out "$out/overhead" ${OVERHEAD_ARGS:-}; pack ;;
  two-gpu)
    python3 bench/layouts.py --out "$out/layouts"; pack
    CUDA_VISIBLE_DEVICES=0 python3 bench/checkpoint.py --out "$out/checkpoint" --dir "${CKPT_DIR:-/tmp/mimo-bench-ckpt}"
    pack ;;
  loop-overhead)
    python3 bench/loop_overhead.py --out "$out/overhead" --rounds 10 --block 6; pack ;;
  *) echo "unknown set '$what': one-gpu, two-gpu or loop-overhead"; exit 2 ;;
esac
