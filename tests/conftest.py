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

from helpers import shared_artifact

# megatron-core's fused functions (jit_fuser) go through torch.compile, and on a CPU inductor spends seconds per graph
# in the tests that build models in-process (11 s for one HybridModel test, 2 s without). mimo runs them eagerly
# unless --torch-compile on (core/run/compilation.py), so the in-process tests run them as mimo does. Set before
# torch is imported (torch._dynamo.config reads it once); subprocesses inherit it, and mimo's own setting wins there.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
# Two workers share two cores: one compute thread each, in the tests' own processes and the commands they start. Set
# before torch is imported: OpenMP reads it when torch loads, and a thread pool made before a DataLoader forks its
# workers can crash them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Seconds the slow tests took (12 s and more; `--durations=150` on two cores shared with other work): "file::test
# function" (each parameter case), or "file" for the tests of a file that share module-scoped set-up (all of them
# together). The slowest start first, so that the last to start are short and the two workers end together; the
# rest follow in collection order. Refresh it when --durations shows a new slow test.
SLOW: dict[str, float] = {
    "test_readme.py::test_readme_block_runs_as_written": 298,
    "test_data_loop.py": 210,
    "test_qwen35_alone.py::test_the_family_installed_alone_passes_the_contract_trains_resumes_and_exports": 116,
    "test_fault_battery.py::test_the_fault_battery_passes": 112,
    "test_hf_parts.py": 36,
    "test_hf_stages.py::test_the_documented_stage_recipe_runs_and_trains_what_each_stage_names": 12,
    "test_lora.py": 70,
    "test_data_formats.py": 70,
    "test_real_shaped_data.py": 70,  # 162 s at a load average of 8-16, 45 s of CPU
    "test_layouts.py": 65,
    "test_peft_export.py::test_a_peft_adapter_on_the_base_gives_the_merged_models_logits": 45,
    "test_orphans.py::test_kills_of_the_main_process_leave_nothing_behind": 38,
    "test_generation_cli.py": 34,
    "test_first_contact.py::test_summary_heterogeneous_save_and_a_resume_with_nothing_left": 32,
    "test_data_skips.py": 32,
    "test_data_docs.py": 32,
    "test_launch.py::test_two_launchers_on_one_host_make_one_world": 31,
    "test_layouts_from_weights.py": 28,
    "test_nemotron_pretrained.py": 27,
    "test_data_stops.py": 27,
    "test_context_parallel.py::test_cp2_gives_the_losses_and_gradient_norms_of_one_process": 27,
    "test_api_contract.py": 35,  # the built-in providers' full checks, shared with the hookspec test
    "test_lora.py::test_expert_parallel_adapters_give_the_single_process_losses": 23,
    "test_hf_generate_parity.py": 22,
    "test_first_contact.py::test_a_whole_run_in_one_file": 22,
    # scaled from 5.3 s and 4.7 s on idle cores as the CP 2 test's 27 from its 6.6 s there
    "test_context_parallel.py::test_heterogeneous_cp2_gives_the_losses_and_gradient_norms_of_one_process": 22,
    "test_hf_train_parity.py::test_the_first_training_loss_from_hugging_face_weights_is_transformers_loss": 21,
    "test_scaffold.py::test_scaffolded_provider_installs_trains_and_passes_its_tests": 20,
    "test_context_parallel.py::test_a_heterogeneous_cp2_checkpoint_resumes_exactly": 19,
    "test_bench.py::test_data_loader_benchmark_packs_what_training_reads": 18,
    "test_save_interrupt.py::test_two_ctrl_c_during_a_save_finish_the_save_and_stop_in_one_line": 16,
    "test_first_contact.py::test_verbose_and_log_file_show_the_libraries_notices": 16,
    "test_finetune_path.py::test_convert_finetune_resume_evaluate_answer_export_and_load_in_transformers": 16,
    "test_save_interrupt.py::test_a_second_ctrl_c_during_the_stop_save_finishes_it": 15,
    "test_launch.py::test_srun_tasks_are_the_ranks": 15,
    "test_checkpoint.py::test_resume_matches_an_uninterrupted_run_bit_for_bit": 14,
    "test_nemotron_training.py::test_tiny_trains_alike_colocated_and_heterogeneous": 12,
    "test_data_convert.py::test_a_converted_llava_dataset_trains_evaluates_and_answers_on_the_qwen_vlm": 40,
    "test_qwen35_peft_export.py::test_a_peft_adapter_on_the_base_gives_the_merged_models_logits": 35,
    "test_qwen35_generate.py::test_mimo_generate_gives_transformers_tokens_for_a_prompt_with_an_image": 25,
    "test_qwen35_chat.py": 21,  # the tokenizer fixture is module-scoped
    "test_qwen35_training.py::test_a_checkpoint_resumes_in_another_layout_as_the_run_it_was_saved_in": 19,
}


@pytest.fixture
def tmp_target(tmp_path):
    target = tmp_path / "site"
    target.mkdir()
    return target


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



class _GroupSuffix:
    """An xdist worker under --dist loadgroup names each grouped test "nodeid@group": the scheduler reads the group
    there. pytest-xdist 3.8 writes it to `item._nodeid`, which pytest 9.2 no longer reads (its node ids are
    structured: pytest-xdist issue 1386), and every group was silently split over both workers, each building the
    group's module-scoped fixtures; this writes the suffix where pytest reads the node id, where it is missing. (A
    plugin of its own: a conftest module holds one function of a hook's name.)"""

    @pytest.hookimpl(trylast=True)  # after the conftest's marks and pytest-xdist's own suffixing
    def pytest_collection_modifyitems(self, config, items):
        if not getattr(config.option, "loadgroup", False):
            return
        from _pytest.nodeid import NodeId

        for item in items:
            mark = item.get_closest_marker("xdist_group")
            if mark is None or "@" in item.nodeid.rpartition("]")[2]:  # no group, or suffixed already
                continue
            group = mark.args[0] if mark.args else mark.kwargs.get("name", "default")
            item._id = NodeId.parse(f"{item.nodeid}@{group}")


def pytest_configure(config):
    config.pluginmanager.register(_GroupSuffix(), "mimo-loadgroup-suffix")
