#!/usr/bin/env bash
# Install the NEWEST releases that pyproject.toml's bounds allow (not the lock) into .venv-latest and run the
# smoke set: train, save, resume with identical losses, energon data, `mimo plan`, provider discovery.
# This is how a new release of torch, megatron-energon, typer, ... that breaks mimo is seen before users see it.
#   bash scripts/test-latest.sh            newest releases
#   bash scripts/test-latest.sh --lowest   the lowest releases the bounds allow for mimo's direct dependencies
# Extra arguments go to pytest. See docs/development.md.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

resolution=highest venv=.venv-latest
if [ "${1:-}" = "--lowest" ]; then
  resolution=lowest-direct venv=.venv-lowest
  shift
fi
uv=$(ensure_uv)
python=$(find_python)
rm -rf "$venv"
"$uv" venv -q --seed --python "$python" "$venv"   # --seed: tests pip-install throwaway provider packages
# --refresh: ask the registry now, not a cached answer from an earlier run. --compile-bytecode, as pip does: else
# the first import of each module compiles it and prints the dependencies' SyntaxWarnings into the runs' stderr.
"$uv" pip install -q --refresh --compile-bytecode --python "$venv/bin/python" --resolution "$resolution" -e ".[dev,hf]"

# mimo's direct dependencies, and the newest release of each on the registry whatever the bounds say.
direct=$("$venv/bin/python" -c '
import re
from importlib.metadata import requires
print("\n".join(sorted({re.split(r"[ ;<>=!~\[]", r)[0] for r in requires("mimo")
                         if "extra ==" not in r or "\"dev\"" in r or "\"hf\"" in r})))')
newest=$("$uv" pip compile -q --no-deps --no-header --no-annotate --python-version 3.12 - <<<"$direct")
echo "== $resolution releases allowed by pyproject.toml (not the lock):"
for name in $direct; do
  have=$("$venv/bin/python" -c "from importlib.metadata import version; print(version('$name'))")
  latest=$(grep -i "^$name==" <<<"$newest" | cut -d= -f3)
  note=""; [ "$have" = "$latest" ] || note="   (newest on the registry: $latest, outside the bounds or not chosen)"
  printf '   %-20s %s%s\n' "$name" "$have" "$note"
done
echo "== smoke set"
exec "$venv/bin/python" -m pytest -m smoke -n 2 --dist loadgroup --no-loadscope-reorder --durations=10 -p no:cacheprovider "$@"
