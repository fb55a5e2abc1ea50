#!/usr/bin/env bash
# Refresh requirements.lock, the exact versions `scripts/setup.sh` (and so CI) installs, for Python 3.12 on
# x86_64 Linux, from pyproject.toml's dependencies and the `dev` and `hf` extras.
#   bash scripts/lock.sh                         keep every locked version that still satisfies pyproject.toml
#   bash scripts/lock.sh --upgrade-package NAME  move one package (and what it needs) to its newest allowed release
#   bash scripts/lock.sh --upgrade               move everything to the newest allowed releases
# Run it in the same commit as any change to the dependencies in pyproject.toml, then `bash scripts/test.sh`.
# Before upgrading, `bash scripts/test-latest.sh` shows whether the newest releases work (docs/development.md).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
uv=$(ensure_uv)
"$uv" pip compile pyproject.toml --extra dev --extra hf --python-version 3.12 --python-platform x86_64-unknown-linux-gnu \
  --quiet --output-file requirements.lock --custom-compile-command "bash scripts/lock.sh" "$@"
echo "requirements.lock: $(grep -c '==' requirements.lock) packages; torch $(sed -n 's/^torch==//p' requirements.lock)"
