# Shared by the GPU procedures (slice.sh, dense.sh, decoding.sh, benchmarks.sh); sourced, not run.
#
# A fresh GPU machine gets its software in two device calls in a row, both from the repository root (a machine
# stays warm about 30 s after a call, so send the second at once; a second call that lands on a fresh machine
# stops with exit 3 and the pair is repeated):
#   1  carry [".whl-te"]  bash scripts/gpu/NAME.sh install   transformer-engine, mamba-ssm, causal-conv1d
#   2  carry [".whl"]     bash scripts/gpu/NAME.sh run       mimo and its dependencies, then the measurement
# Fill .whl-te and .whl here first: `bash scripts/gpu/NAME.sh prepare [COMMIT]` (COMMIT: a commit to measure
# beside this checkout; its code goes to bench_baseline/, untracked, so that it travels with the tree).

# where the carry scripts live (they fill .whl-te and .whl; see their headers)
CARRY_DIR=${MIMO_CARRY_DIR:-../shared/gpu}
BASELINE="$PWD/bench_baseline"

# prepare [COMMIT]: on this machine, not the GPU one: the wheels of both calls, and COMMIT's code as the baseline
prepare() {
  bash "$CARRY_DIR/carry-te.sh" && bash "$CARRY_DIR/carry.sh" || return 1
  rm -rf "$BASELINE"
  if [ -n "${1:-}" ]; then
    mkdir -p "$BASELINE" && git archive "$1" --prefix=mimo/ | tar -x -C "$BASELINE" || return 1
    echo "baseline: $1 in bench_baseline/ (untracked: do not commit it)"
  fi
}

# install_te: device call 1, the transformer-engine stack into /tmp/te-site
install_te() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/te-site .whl-te/*.whl \
    && touch /tmp/te-site/ok || exit 3
}

# use_wheels [te]: device call 2, mimo's wheels into /tmp/site; with "te", the stack of call 1 must be there
use_wheels() {
  if [ -n "${MIMO_WHEELS_READY:-}" ]; then  # a script of this call installed them (others import from there now)
    export PYTHONPATH=/tmp/site:/tmp/te-site; return
  fi
  if [ "${1:-}" = te ]; then
    test -f /tmp/te-site/ok || { echo "transformer-engine stack missing: the machine is new; repeat call 1"; exit 3; }
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 3
  # mimo itself from this checkout, not the wheel `prepare` built: a wheel built before the latest commits measures
  # old code and lacks newer entry points (providers). setuptools is on the GPU image; no network is needed.
  if python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
      --target /tmp/mimo-src . >/dev/null 2>&1; then
    rm -rf /tmp/site/mimo /tmp/site/mimo-*.dist-info && cp -r /tmp/mimo-src/mimo /tmp/mimo-src/mimo-*.dist-info /tmp/site/
    echo "mimo: built from this checkout"
  else
    echo "mimo: the wheel from prepare (building this checkout failed): run prepare again after each commit"
  fi
  export PYTHONPATH=/tmp/site:/tmp/te-site
}

# versions FILE: the GPU, driver and the kernels' libraries, for the record
versions() {
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    python3 -c "import transformer_engine as te, mamba_ssm; print('transformer_engine', te.__version__, \
'mamba_ssm', mamba_ssm.__version__)" 2>/dev/null
  } > "$1" 2>&1
  cat "$1"
}

# has_baseline: a commit's code was prepared for comparison
has_baseline() { test -f "$BASELINE/mimo/__init__.py"; }

# measure NAME CASE ITERATIONS WARMUP FIRST_CAP [te_path options for a comparison run]: bench/te_path.py's CASE
# in one call of LIMIT seconds (default 540: a 600 s call less the transfers). This checkout runs first, on an
# empty kernel cache (its first iteration is a fresh machine's). Then, while time is left, in turn: the baseline
# (a prepared commit's code) if there is one, else the comparison options if given; and this checkout again.
# Runs of one call see the same data in the same order, so their iterations compare one by one. Results:
# $OUT/NAME.tgz (logs, metrics, records; rewritten after every run, so a call stopped early keeps what finished),
# and the summary table of every run last in the output.
measure() {
  local name=$1 case=$2 iterations=$3 warmup=$4 first_cap=$5
  shift 5
  local other=("$@") limit=${LIMIT:-540} results=/tmp/mimo-gpu/$name
  has_baseline && other=(--baseline-src "$BASELINE")
  mkdir -p "$results"
  export MIMO_COMPILE_CACHE=/tmp/mimo-gpu/kernel-cache
  versions "$results/versions.txt"
  local n=0
  one_run() {  # CAP [te_path options]: one run, stopped after CAP seconds or at the call's limit
    local cap=$1 left=$(( limit - SECONDS - 10 ))
    shift
    (( cap > left )) && cap=$left
    (( cap < 60 )) && return 1
    n=$(( n + 1 ))
    timeout -k 10 "$cap" python3 bench/te_path.py --out "$results/run$n" --timeout $(( cap - 20 )) --cases "$case" \
      --iterations "$iterations" --warmup "$warmup" "$@" 2>&1 | tee -a "$results/console.log"
    tar czf "$OUT/$name.tgz" --exclude='trace_*' -C /tmp/mimo-gpu "$name" 2>/dev/null
    return 0
  }
  one_run "$first_cap" || return 1
  local round
  for round in 1 2 3; do  # at most three more pairs (a run that fails at once must not repeat to the limit)
    local share=$(( (limit - SECONDS) / 2 ))
    if (( ${#other[@]} )); then one_run "$share" "${other[@]}" || break; fi
    one_run "$share" || break
  done
  python3 bench/te_path.py --summarize "$results"
}
