#!/usr/bin/env bash
# Create (or update) the project's Python 3.12 virtualenv in .venv and install mimo into it, editable, with the
# test tools. Safe to run again: an up-to-date .venv costs a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for candidate in "${MIMO_PYTHON:-}" python3.12 "$(command -v pyenv >/dev/null && pyenv root)/versions/3.12.1/bin/python3.12"; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "error: Python 3.12 is needed (megatron-core 0.19 requires it); install it or set MIMO_PYTHON" >&2
  return 1
}

if [ ! -x .venv/bin/python ]; then
  python=$(find_python)
  "$python" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# pip prints one warning per package for local index folders that some machines configure; they are harmless.
.venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import mimo, megatron.core, megatron.energon" 2>/dev/null \
  || { echo "error: the install in .venv is incomplete; see the pip output above" >&2; exit 1; }
