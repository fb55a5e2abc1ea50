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

# Seconds the slow tests took (25 s and more; `--durations=0` on two cores shared with other work): "file::test
# function" (each parameter case), or "file" for the tests of a file that share module-scoped set-up (all of them
# together). The slowest start first, so that the last to start are short and the two workers end together; the
# rest follow in collection order. Refresh it when --durations shows a new slow test.
SLOW: dict[str, float] = {
    "test_first_contact.py::test_a_whole_run_in_one_file": 337,
    "test_hf_generate_parity.py": 297,
    "test_readme.py::test_readme_block_runs_as_written": 292,
    "test_data_loop.py": 282,
    "test_data_docs.py": 267,
    "test_generation_cli.py": 256,
    "test_first_contact.py::test_plain_install_without_extras_trains_evaluates_plans_and_says_what_an_extra_adds": 242,
    "test_hf_parts.py": 236,
    "test_first_contact.py::test_summary_heterogeneous_save_and_a_resume_with_nothing_left": 216,
    "test_fault_battery.py::test_the_fault_battery_passes": 195,
    "test_hf_stages.py::test_the_documented_stage_recipe_runs_and_trains_what_each_stage_names": 182,
    "test_checkpoint.py::test_broken_checkpoints_are_one_clear_line": 171,
    "test_generation_docs.py::test_the_documented_example_runs": 156,
    "test_checkpoint.py::test_resume_matches_an_uninterrupted_run_bit_for_bit": 155,
    "test_layouts.py": 280,
    "test_lora.py": 250,
    "test_layouts_from_weights.py": 150,
    "test_checkpoint.py::test_distributed_optimizer_resume_matches_an_uninterrupted_run_bit_for_bit": 134,
    "test_performance_options.py::test_overlapped_communication_trains_the_same_model": 128,
    "test_data_formats.py": 123,
    "test_checkpoint.py::test_resume_at_another_data_parallel_size_with_a_fully_reshardable_optimizer": 112,
    "test_checkpoint.py::test_constant_structure_saves_twice_and_the_later_checkpoint_loads": 99,
    "test_nemotron_pretrained.py": 85,
    "test_checkpoint.py::test_finetune_and_pretrained_start_from_the_weights_at_iteration_zero": 80,
    "test_checkpoint.py::test_dp_sharded_optimizer_state_refuses_another_dp_size": 80,
    "test_checkpoint.py::test_bf16_weights_loaded_without_optimizer_state_survive_the_first_step": 77,
    "test_data_stops.py": 76,
    "test_orphans.py::test_kills_of_the_main_process_leave_nothing_behind": 66,
    "test_evaluation.py": 60,
    "test_context_parallel.py::test_cp2_gives_the_losses_and_gradient_norms_of_one_process": 27,
    "test_checkpoint.py::test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable": 57,
    "test_checkpoint_compat.py::test_resuming_with_a_larger_train_iters_equals_an_uninterrupted_run": 55,
    "test_hf_import_export.py::test_a_dense_llm_imports_into_tensor_parallel_ranks_and_exports_from_them": 54,
    "test_nemotron_checkpoint.py::test_nemotron_checkpoints_load_strictly_in_any_layout": 52,
    "test_hf_import_export.py::test_training_from_the_import_or_the_folder_and_exporting_a_heterogeneous_checkpoint":
        51,
    "test_first_contact.py::test_verbose_and_log_file_show_the_libraries_notices": 49,
    "test_scaffold.py::test_scaffolded_provider_installs_trains_and_passes_its_tests": 47,
    "test_hf_export.py::test_an_exportable_run_loads_and_generates_with_transformers_alone": 46,
    "test_peft_export.py::test_a_peft_adapter_on_the_base_gives_the_merged_models_logits": 45,
    "test_data_formats.py::test_the_nemotron_vlm_trains_on_a_chat_dataset": 46,
    "test_data_skips.py": 45,
    "test_plan.py::test_mimo_plan_command": 45,
    "test_encoder_pass.py::test_step_pass_trains_like_micro_batch_pass": 44,
    "test_first_contact.py::test_cpu_runs_speak_per_rank_and_pretrained_says_what_it_loaded": 43,
    "test_training.py::test_same_seed_repeats_and_other_seed_differs": 43,
    "test_performance_options.py::test_runs_that_cannot_work_here_stop_with_one_line": 42,
    "test_nemotron_training.py::test_tiny_trains_alike_colocated_and_heterogeneous": 41,
    "test_startup_checks.py::test_a_checkpoint_of_another_shape_is_refused_naming_the_setting": 40,
    "test_hf_export.py::test_default_settings_are_told_at_start_and_export_names_every_setting_at_once": 38,
    "test_launch.py::test_two_launchers_on_one_host_make_one_world": 37,
    "test_performance_options.py::test_recomputation_trains_the_same_model": 37,
    "test_checkpoint.py::test_weights_only_checkpoint_warns_and_starts_a_fresh_optimizer": 37,
    "test_tokenizer.py": 36,
    "test_evaluation_docs.py::test_the_documented_example_runs_and_mimo_eval_matches_the_last_in_run_evaluation": 33,
    "test_nemotron_training.py::test_stage1_trains_the_projection_only": 32,
    "test_signals.py::test_two_processes_stop_together_and_save": 32,
    "test_data_convert.py::test_convert_llava_then_train_and_evaluate": 32,
    "test_evaluation.py::test_evaluation_leaves_training_and_resume_exactly_as_they_were": 30,
    "test_memory.py::test_plan_54l_one_rank_refused_32_ranks_fit": 30,
    "test_bench.py::test_data_loader_benchmark_packs_what_training_reads": 30,
    "test_hf_train_parity.py::test_the_first_training_loss_from_hugging_face_weights_is_transformers_loss": 28,
    "test_checkpoint_compat.py::test_an_unreadable_checkpoint_is_one_line_whatever_the_library_raises": 27,
    "test_signals.py::test_workers_of_a_launcher_killed_outright_stop_and_save": 27,
    "test_telemetry.py::test_module_timing_summary_on_the_logging_rank_only": 27,
    "test_checkpoint.py::test_async_save_keep_last_and_inspect": 25,
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
