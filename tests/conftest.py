"""Shared fixtures, artifacts built once per test run, and the order tests start in.

Folders by kind: unit/ (in-process, a world of one at most), multiprocess/ (`mimo` subprocesses, gloo worlds of
several processes), commands/ (whole commands as a newcomer or a doc runs them), records/ (benchmark code and the
GPU records kept in docs/benchmarks/). Helpers shared by all of them live here in tests/."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

# megatron-core's fused functions (jit_fuser) go through torch.compile, and on a CPU inductor spends seconds per graph
# in the tests that build models in-process (11 s for one HybridModel test, 2 s without). mimo runs them eagerly
# unless --torch-compile on (core/run/compilation.py), so the in-process tests run them as mimo does. Set before
# torch is imported (torch._dynamo.config reads it once); subprocesses inherit it, and mimo's own setting wins there.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

# Seconds the slow tests took, from `--durations=0` on two shared cores: "file::test function" (each parameter
# case), or "file" for the tests of a file that share module-scoped set-up (all of them together). The slowest start
# first, so that the last to start are short and the two workers end together; the rest follow in collection order.
SLOW: dict[str, float] = {
    "test_readme.py::test_readme_block_runs_as_written": 400,
    "test_fault_battery.py::test_the_fault_battery_passes": 200,
    "test_generation_cli.py": 200,
    "test_data_formats.py": 200,
    "test_orphans.py::test_kills_of_the_main_process_leave_nothing_behind": 150,
    "test_layouts.py": 150,
    "test_data_stops.py": 150,
    "test_hf_train_parity.py::test_the_first_training_loss_from_hugging_face_weights_is_transformers_loss": 120,
    "test_hf_generate_parity.py": 120,
    "test_hf_stages.py::test_the_documented_stage_recipe_runs_and_trains_what_each_stage_names": 120,
    "test_hf_parts.py": 100,
    "test_data_docs.py": 100,
    "test_nemotron_training.py::test_stage1_trains_the_projection_only": 100,
    "test_first_contact.py::test_plain_install_without_extras_trains_evaluates_plans_and_says_what_an_extra_adds": 90,
    "test_first_contact.py::test_a_whole_run_in_one_file": 90,
    "test_first_contact.py::test_summary_heterogeneous_save_and_a_resume_with_nothing_left": 90,
    "test_nemotron_pretrained.py": 80,
    "test_tokenizer.py": 80,
    "test_data_loop.py": 80,
    "test_data_skips.py": 80,
    "test_evaluation.py": 60,
}


@pytest.fixture
def tmp_target(tmp_path):
    target = tmp_path / "site"
    target.mkdir()
    return target


def shared_artifact(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder `name`, built by `build(folder)` once per test run, whichever xdist worker asks first.

    Each xdist worker is a session of its own with its own basetemp under the run's; the artifact goes into the run's
    folder, and a file lock makes the other workers wait for it and reuse it. Tests must only read it."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    root = base / "shared"
    root.mkdir(exist_ok=True)
    done = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            partial = root / f"{name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            build(partial)
            partial.rename(done)  # complete or absent: a failed build is retried by the next test that asks
    return done


@pytest.fixture(scope="session")
def omni_folder(tmp_path_factory) -> Path:
    """hf_models.save_omni(TEXT): a tiny random transformers omni VLM, saved (read-only; seeded, so every test that
    saved its own got these bytes)."""
    from hf_models import TEXT, save_omni

    return shared_artifact(tmp_path_factory, "omni", lambda folder: save_omni(folder, TEXT))


@pytest.fixture(scope="session")
def omni_imported(tmp_path_factory, omni_folder) -> tuple[Path, str]:
    """(checkpoint, stdout) of `mimo ckpt import-hf` of omni_folder (read-only)."""
    from helpers import run_mimo

    def build(folder: Path) -> None:
        result = run_mimo("ckpt", "import-hf", str(omni_folder), str(folder / "ckpt"),
                          env={"TORCH_COMPILE_DISABLE": "1"})
        assert result.returncode == 0, result.stderr[-3000:]
        (folder / "stdout.txt").write_text(result.stdout)

    folder = shared_artifact(tmp_path_factory, "omni-imported", build)
    return folder / "ckpt", (folder / "stdout.txt").read_text()


@pytest.fixture(scope="session")
def sample_dataset(tmp_path_factory) -> Callable[[Path], Path]:
    """copy(dest): `mimo data sample DIR --num-samples 48 --val-shards 1`, run once per test run, copied to dest.
    The command writes the same samples whatever DIR is (a fixed seed); each test gets a copy it may change."""
    from helpers import SAMPLE_ARGS, run_mimo

    def build(folder: Path) -> None:
        result = run_mimo("data", "sample", str(folder / "ds"), *SAMPLE_ARGS)
        assert result.returncode == 0, result.stderr[-3000:]

    built = shared_artifact(tmp_path_factory, "sample-dataset", build) / "ds"
    return lambda dest: Path(shutil.copytree(built, dest))


def _file_of(item) -> str:
    return Path(str(item.fspath)).name


def _shares_module_setup(item) -> bool:
    """Whether the test uses a module-scoped fixture (a training run, a world of one, a built dataset)."""
    return any(defs[-1].scope == "module" for defs in item._fixtureinfo.name2fixturedefs.values())


def _seconds(item) -> float:
    name = _file_of(item)
    if _shares_module_setup(item):
        return SLOW.get(name, 0.0)
    return SLOW.get(f"{name}::{item.originalname}", 0.0)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    # Under --dist loadgroup, the tests of a file that share module-scoped set-up run on one worker (it is built once);
    # every other test is scheduled on its own.
    for item in items:
        if _shares_module_setup(item):
            item.add_marker(pytest.mark.xdist_group(_file_of(item)))
    # Slowest first; a stable sort, so a file's cases keep their order (and a group stays in one piece).
    items.sort(key=lambda item: -_seconds(item))
