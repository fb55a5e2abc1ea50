#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers (the machine's two cores): most tests are single-threaded subprocess runs.
# --dist loadgroup schedules each test on its own, except the files tests/conftest.py keeps together (module-scoped
# runs and worlds); --no-loadscope-reorder keeps conftest's order (slowest first) instead of the largest groups first.
# --durations=10 prints the ten slowest tests at the end of every run.
exec .venv/bin/python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder --durations=10 "$@"
