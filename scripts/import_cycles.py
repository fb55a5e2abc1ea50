"""Import cycles among mimo's modules, modules over the length limit, and the rules between its rooms.

    python scripts/import_cycles.py [--max-lines N]

Reads every `import` statement of the package with `ast`, at module level and inside functions alike (a cycle
behind a function-local import is still a cycle: the two modules cannot be understood, nor split, apart). Relative
imports are resolved; `from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg` (its
`__init__`). A cycle is a strongly connected set of modules, or of packages taken whole at any depth (the
top-level rooms mimo.core, mimo.plugins, ...; core's sub-packages mimo.core.run, mimo.core.checkpoint, ...).
Prints each cycle, each module over the limit and each import that breaks a room rule (ROOM_RULES); exits 1 when
there is one. tests/unit/test_architecture.py runs it.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root is the `mimo` package
PACKAGE = "mimo"
NOT_PACKAGE = {"tests", "bench", "scripts", "docs", "build", "dist", "templates"}  # folders outside `mimo`
MAX_LINES = 450

# Which of mimo's modules each room may import (its own room always): core knows no provider; a provider knows
# only the public API (mimo, mimo.plugins with its kit and data pieces, mimo.errors) and its own package.
PUBLIC_API = ("mimo", "mimo.errors", "mimo.plugins")
BOTTOM = ("mimo.errors", "mimo.wording")  # modules that import none of mimo's: every room may use them
ROOM_RULES = {
    "mimo.core": lambda target: not target.startswith("mimo.providers"),
    "mimo.providers": lambda target: target in PUBLIC_API or target.startswith("mimo.plugins."),
    "mimo.data": lambda target: target in BOTTOM,
    "mimo.plugins": lambda target: target in BOTTOM or target.startswith("mimo.data"),
}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} for every module of the package."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in NOT_PACKAGE or p.startswith(".") for p in parts[:-1]):
            continue
        names = [PACKAGE, *parts[:-1]] + ([] if parts[-1] == "__init__.py" else [parts[-1][:-3]])
        found[".".join(names)] = path
    return found


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _known(name: str, known: dict[str, Path]) -> str | None:
    """`name`, or the nearest package above it that is a module of ours."""
    parts = name.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts) if parts else None


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(module of ours, line) for every import `module` makes, anywhere in its file."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(_known(a.name, known), node.lineno) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module) if node.level else node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in known else _known(target, known), node.lineno))
    return [(target, line) for target, line in found if target and target != module]


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: {t for t, _ in imports(name, path, known)} for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index, low, on_stack, stack, result = {}, {}, set(), [], []

    def enter(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)

    for start in sorted(edges):
        if start in index:
            continue
        enter(start)
        work = [(start, iter(sorted(edges.get(start, ()))))]
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    enter(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        result.append(sorted(component))
    return result


def long_modules(root: Path = ROOT, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(path, lines) of every Python file outside tests/ longer than `limit`: the package, bench/ and scripts/."""
    long = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in ("tests", "build", "dist") or any(p.startswith(".") for p in parts):
            continue
        if (n := len(path.read_text().splitlines())) > limit:
            long.append((str(path.relative_to(root)), n))
    return long


def room_violations(root: Path = ROOT) -> list[str]:
    """`file:line imports module` for each import a room's rule forbids."""
    known = modules(root)
    found = []
    for name, path in known.items():
        room = next((r for r in ROOM_RULES if name == r or name.startswith(r + ".")), None)
        if room is None:
            continue
        own = ".".join(name.split(".")[:3]) if room == "mimo.providers" else room
        for target, line in imports(name, path, known):
            if not (target == own or target.startswith(own + ".") or ROOM_RULES[room](target)):
                found.append(f"{path.relative_to(root)}:{line} imports {target}")
    return list(dict.fromkeys(found))


def package_of(module: str, depth: int, known: dict[str, Path]) -> str:
    """The package `depth` names deep that holds `module` (mimo.core at 2, mimo.core.run at 3), or the module itself
    where no package that deep holds it (mimo.errors at 2, mimo.core.config at 3)."""
    parts = module.split(".")
    prefix = ".".join(parts[:depth])
    return prefix if len(parts) >= depth and known.get(prefix, Path()).name == "__init__.py" else module


def package_cycles(root: Path = ROOT) -> list[list[str]]:
    """Cycles among packages taken whole, at every depth: the top-level rooms (mimo.core, mimo.plugins, mimo.data,
    ...), then their sub-packages (mimo.core.run, mimo.core.checkpoint, ...), and so on. Two packages that import
    each other are one room in fact, whichever modules the imports go between."""
    known, edges = modules(root), graph(root)
    found = []
    for depth in range(2, max(len(name.split(".")) for name in known) + 1):
        collapsed: dict[str, set[str]] = {}
        for module, targets in edges.items():
            node = package_of(module, depth, known)
            collapsed.setdefault(node, set()).update(
                package_of(t, depth, known) for t in targets if package_of(t, depth, known) != node)
        found += [c for c in cycles(collapsed) if c not in found]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-lines", type=int, default=MAX_LINES)
    args = parser.parse_args()
    found, long, broken = cycles(graph()) + package_cycles(), long_modules(limit=args.max_lines), room_violations()
    for component in found:
        print("cycle: " + " <-> ".join(component))
    for path, n in long:
        print(f"too long: {path} has {n} lines (limit {args.max_lines})")
    for line in broken:
        print(f"room rule: {line}")
    if not (found or long or broken):
        print(f"no import cycle among {len(modules())} modules or their packages; none over {args.max_lines} lines; "
              "rooms kept")
    return 1 if found or long or broken else 0


if __name__ == "__main__":
    sys.exit(main())
