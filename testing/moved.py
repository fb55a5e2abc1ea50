"""What moved in mimo's provider-facing API when mimo was regrouped into rooms, and a look at a provider
package's imports for the old paths (a note in the contract report, not a failure).

    mimo.plugins.memory_layers     -> mimo.plugins.kit.memory_layers     (the old path still works)
    mimo.plugins.dist_checkpoint   -> mimo.plugins.kit.dist_checkpoint   (the old path still works)
    mimo.plugins.attention         -> mimo.plugins.kit.attention         (the old path still works)
    mimo.plugins.hf.safetensors_io -> mimo.plugins.kit.safetensors_io
    mimo.plugins.hf.<map>          -> mimo.providers.nemotron.hf.<map>   (the Nemotron family's tensor maps)
    mimo.core.data                 -> mimo.data                          (use mimo.plugins.data, the public part)

`mimo`, `mimo.plugins` (hooks, records, settings, `LANGUAGE`, `module_prefix`, `SDPAttention`), `mimo.plugins.data`,
`mimo.errors` and `mimo.testing` did not move.
"""

from __future__ import annotations

import ast
from pathlib import Path

MOVED = {  # old module -> (new module, whether the old path still imports)
    "mimo.plugins.memory_layers": ("mimo.plugins.kit.memory_layers", True),
    "mimo.plugins.dist_checkpoint": ("mimo.plugins.kit.dist_checkpoint", True),
    "mimo.plugins.attention": ("mimo.plugins.kit.attention", True),
    "mimo.plugins.hf.safetensors_io": ("mimo.plugins.kit.safetensors_io", False),
    "mimo.plugins.hf.nemotron_h": ("mimo.providers.nemotron.hf.nemotron_h", False),
    "mimo.plugins.hf.nemotron_h_omni": ("mimo.providers.nemotron.hf.nemotron_h_omni", False),
    "mimo.plugins.hf.radio": ("mimo.providers.nemotron.hf.radio", False),
    "mimo.plugins.hf": ("mimo.providers.nemotron.hf", False),
    "mimo.core.data": ("mimo.data", False),
}


def moved_imports(module) -> list[str]:
    """One note per import of a moved path in `module`'s source (all of its package's files for a package)."""
    path = Path(getattr(module, "__file__", "") or "")
    if not path.is_file():
        return []
    files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
    notes = []
    for file in files:
        try:
            tree = ast.parse(file.read_text(), str(file))
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            names = [n for n in _imported(node) if _moved_from(n)]
            for name in names:
                if any(other.startswith(name + ".") for other in names):
                    continue  # `from mimo.plugins.hf import safetensors_io`: the module named, not its package
                old = _moved_from(name)
                new, works = MOVED[old]
                notes.append(f"{file.name}:{node.lineno} imports {name}, which moved to {new + name[len(old):]}"
                             + (" (the old path still works)" if works else " (the old path is gone)"))
    return notes


def _moved_from(name: str) -> str | None:
    """The most specific moved path that `name` is or lies under."""
    matches = [old for old in MOVED if name == old or name.startswith(old + ".")]
    return max(matches, key=len) if matches else None


def _imported(node) -> list[str]:
    """The modules (and `from` targets) an import statement names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return []
