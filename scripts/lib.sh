# Shared by the scripts in this folder (sourced, not run).

# A Python 3.12 interpreter: $MIMO_PYTHON, python3.12 on PATH, or pyenv's 3.12.1.
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

# uv, the resolver behind the lock and the newest-release check, in a virtualenv of its own (.tools).
UV_VERSION=0.13.9
ensure_uv() {
  if [ ! -x .tools/bin/uv ] || [ "$(.tools/bin/uv --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
    "$(find_python)" -m venv .tools
    .tools/bin/python -m pip install -q "uv==$UV_VERSION" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  fi
  echo .tools/bin/uv
}
