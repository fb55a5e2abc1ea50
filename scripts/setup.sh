#!/usr/bin/env bash
# Create (or update) the project's Python 3.12 virtualenv in .venv with the exact versions in requirements.lock
# (what CI tests), then install mimo into it, editable. Safe to run again: an up-to-date .venv costs seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

quiet() { grep -v "^WARNING: Location" || true; }  # local index folders some machines configure: harmless
if [ ! -x .venv/bin/python ]; then
  python=$(find_python)
  "$python" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | quiet
fi
.venv/bin/python -m pip install -q -r requirements.lock 2>&1 | quiet
# Everything mimo needs came from the lock; --no-deps keeps pip from resolving anything past it.
# (PYTHONWARNINGS: setuptools warns about every editable install of a package whose folder is the repository.)
PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | quiet
.venv/bin/python -m pip check >/dev/null \
  || { .venv/bin/python -m pip check >&2; echo "error: requirements.lock does not satisfy pyproject.toml: run bash scripts/lock.sh" >&2; exit 1; }
.venv/bin/python -c "import mimo, megatron.core, megatron.energon" 2>/dev/null \
  || { echo "error: the install in .venv is incomplete; see the pip output above" >&2; exit 1; }
