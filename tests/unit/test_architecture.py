"""The house rules, checked on the source (scripts/import_cycles.py): no import cycle among modules, function-local
imports included, nor among packages taken whole (the top-level rooms, core's sub-packages); no module outside the tests over 450 lines; core imports no
provider, and providers import only mimo's public API (mimo, mimo.plugins and its kit, mimo.errors)."""

import importlib.util
import subprocess
import sys
import textwrap

from helpers import REPO

SCRIPT = REPO / "scripts" / "import_cycles.py"


def _checker():
    spec = importlib.util.spec_from_file_location("import_cycles", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


checker = _checker()


def test_no_import_cycle_among_modules():
    found = checker.cycles(checker.graph())
    assert not found, "import cycles (function-local imports count): " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_cycle_among_packages():
    found = checker.package_cycles()
    assert not found, "package cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_sibling_of_core_run_imports_it():
    """core/run/ holds the commands and their start-up: the rooms below it (checkpoint, evaluation, generation,
    forward, parallel, ...) never import it."""
    def in_run(name: str) -> bool:
        return name == "mimo.core.run" or name.startswith("mimo.core.run.")

    up = sorted(f"{module} imports {target}" for module, targets in checker.graph().items()
                if module.startswith("mimo.core.") and not in_run(module) for target in targets if in_run(target))
    assert not up, up


def test_the_architecture_doc_names_every_module_of_core():
    """docs/architecture.md's table of core's rooms names each module in its room's row."""
    rows = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        if line.startswith("| `"):
            rows[line.split("`")[1]] = line
    missing = []
    for path in sorted((REPO / "core").rglob("*.py")):
        relative = path.relative_to(REPO / "core")
        if path.name == "__init__.py":
            continue
        room = f"{relative.parts[0]}/" if len(relative.parts) > 1 else relative.name
        if f"`{path.name}`" not in rows.get(room, ""):
            missing.append(str(relative))
    assert not missing, f"docs/architecture.md does not name these modules of core in their room's row: {missing}"


def test_the_checker_finds_a_package_cycle_between_acyclic_modules(tmp_path):
    """run.a -> checkpoint.b -> run.c: no module cycle, but the packages run and checkpoint import each other."""
    core = tmp_path / "core"
    for package in (core / "run", core / "checkpoint"):
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
    (tmp_path / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "run" / "a.py").write_text("from ..checkpoint import b\n")
    (core / "checkpoint" / "b.py").write_text("def f():\n    from ..run import c\n")
    (core / "run" / "c.py").write_text("")
    assert not checker.cycles(checker.graph(tmp_path))
    assert checker.package_cycles(tmp_path) == [["mimo.core.checkpoint", "mimo.core.run"]]


def test_no_module_outside_the_tests_is_over_450_lines():
    assert not checker.long_modules(limit=450), checker.long_modules(limit=450)


def test_core_imports_no_provider_and_providers_only_the_public_api():
    assert not checker.room_violations(), checker.room_violations()


def test_the_script_passes():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_checker_finds_a_cycle_behind_a_function_local_import(tmp_path):
    """Two modules, one importing the other inside a function, the other `from . import` the first: a cycle."""
    package = tmp_path / "pkg"
    package.mkdir()
    (tmp_path / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(textwrap.dedent("""
        def f():
            from .b import g
            return g()
    """))
    (package / "b.py").write_text("from . import a\n\ndef g():\n    return a\n")
    (package / "c.py").write_text("from mimo.pkg.a import f\n")  # an absolute import, no cycle of its own
    found = checker.cycles(checker.graph(tmp_path))
    assert found == [["mimo.pkg.a", "mimo.pkg.b"]], found


def test_the_checker_names_a_provider_importing_core(tmp_path):
    provider = tmp_path / "providers" / "toy"
    provider.mkdir(parents=True)
    for init in (tmp_path / "__init__.py", tmp_path / "providers" / "__init__.py", provider / "__init__.py"):
        init.write_text("")
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "__init__.py").write_text("")
    (tmp_path / "core" / "train.py").write_text("")
    (provider / "model.py").write_text("from mimo.plugins.kit import attention\nfrom mimo.core import train\n")
    (tmp_path / "plugins" / "kit").mkdir(parents=True)
    (tmp_path / "plugins" / "__init__.py").write_text("")
    (tmp_path / "plugins" / "kit" / "__init__.py").write_text("")
    (tmp_path / "plugins" / "kit" / "attention.py").write_text("")
    assert checker.room_violations(tmp_path) == ["providers/toy/model.py:2 imports mimo.core.train"]


def test_moved_public_paths_still_import_as_the_kits_modules():
    import mimo.plugins
    import mimo.plugins.attention
    import mimo.plugins.dist_checkpoint
    import mimo.plugins.kit.attention
    import mimo.plugins.kit.dist_checkpoint
    import mimo.plugins.kit.memory_layers
    import mimo.plugins.memory_layers
    from mimo.testing import MOVED

    assert mimo.plugins.memory_layers is mimo.plugins.kit.memory_layers
    assert mimo.plugins.dist_checkpoint is mimo.plugins.kit.dist_checkpoint
    assert mimo.plugins.attention is mimo.plugins.kit.attention
    assert {old for old, (_, works) in MOVED.items() if works} == {
        "mimo.plugins.memory_layers", "mimo.plugins.dist_checkpoint", "mimo.plugins.attention"}


def test_the_contract_report_notes_moved_imports(tmp_path):
    import types

    from mimo.testing import moved_imports

    source = tmp_path / "old_provider.py"
    source.write_text("from mimo.plugins import memory_layers\nfrom mimo.plugins.hf import safetensors_io\n")
    notes = moved_imports(types.SimpleNamespace(__file__=str(source)))
    assert notes == [
        "old_provider.py:1 imports mimo.plugins.memory_layers, which moved to mimo.plugins.kit.memory_layers "
        "(the old path still works)",
        "old_provider.py:2 imports mimo.plugins.hf.safetensors_io, which moved to mimo.plugins.kit.safetensors_io "
        "(the old path is gone)"], notes


def test_language_is_one_name_exported_by_the_public_api():
    import mimo
    import mimo.plugins
    from mimo.core.parallel import topology

    assert mimo.LANGUAGE == mimo.plugins.LANGUAGE == topology.LANGUAGE == "language"
    assert mimo.module_prefix(mimo.LANGUAGE) == "language_model."
    assert mimo.module_prefix("images") == "modality_submodules.images."


def test_no_merge_conflict_markers_in_tracked_files():
    # A merge once committed its markers into two docs: every tracked text file is checked.
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    marked = []
    for name in files:
        try:
            lines = (REPO / name).read_text().splitlines()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        marked += [f"{name}:{i}" for i, line in enumerate(lines, 1)
                   if line.startswith(("<<<<<<< ", ">>>>>>> "))]
    assert not marked, marked


def test_the_cli_loads_without_torch():
    """`mimo` sets up its console (library notices to the debug log, energon's progress bars off) before torch and
    the libraries load: importing the CLI's modules loads none of them."""
    code = "import sys, mimo.cli.main; print(sorted({'torch', 'tqdm', 'megatron'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
