#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two test files at a time (the machine's two cores): most tests are single-threaded subprocess runs.
# --dist loadfile keeps each file (and its module-scoped runs) in one worker.
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
