"""`check_provider`: every contract check, in the order a run meets them, for one provider."""

from __future__ import annotations

import tempfile
from pathlib import Path

from mimo.plugins import Registry

from .data_check import check_data
from .data_path_check import check_data_path
from .flops_check import check_flops, check_sample_flops
from .kernel_configs_check import check_kernel_configs
from .lora_targets_check import check_lora_targets
from .memory_check import check_module_memory
from .moved import moved_imports
from .model_check import check_model_shape, check_specs, module_reports, vocab_size
from .report import ContractReport
from .settings_check import check_registration, check_settings_round_trip
from .size_check import check_size_settings
from .subject import load_subject
from .train_check import CPU_PARAMETER_LIMIT, check_build_and_train, too_large


def check_provider(name: str, settings=(), *, registry: Registry | None = None, build: bool = True,
                   max_parameters: int = CPU_PARAMETER_LIMIT) -> ContractReport:
    """Check provider `name` with `settings` (`key=value` strings, as `mimo run --set`) against the contract.

    Raises ContractError ("hook: rule") at the first broken rule; returns the report otherwise. `build=False`
    skips the subprocess that builds, trains and checkpoints the model (it needs the provider installed, not
    just in `registry`); so does a model larger than `max_parameters`, with a note saying so.
    """
    subject = load_subject(name, settings, registry)
    report = ContractReport(provider=name)
    check_registration(subject)
    with tempfile.TemporaryDirectory(prefix="mimo-settings-") as directory:
        check_settings_round_trip(subject, Path(directory))
    check_size_settings(subject)
    shapes = check_model_shape(subject)
    report.modules = module_reports(shapes)
    encoders, language = check_specs(subject, shapes)
    report.seq_length = check_data(subject, encoders, vocab_size(language))
    note = check_data_path(subject, encoders, vocab_size(language))
    report.notes += [note] if note else []
    report.flops, note = check_flops(subject, shapes, report.seq_length)
    report.notes += [note] if note else []
    note = check_sample_flops(subject, report.flops, report.seq_length)
    report.notes += [note] if note else []
    note = check_module_memory(subject, shapes)
    report.notes += [note] if note else []
    check_kernel_configs(subject)
    check_lora_targets(subject, shapes)
    report.hooks_called |= subject.called
    report.notes += moved_imports(subject.plugin.module)  # mimo's paths the provider imports that have moved
    skip = "not built: build=False" if not build else too_large(shapes, max_parameters)
    if skip:
        report.notes.append(skip)
        return report
    result = check_build_and_train(name, settings)
    for module, count in result["built_parameters"].items():
        report.modules[module].built_parameters = count
    report.losses = result["losses"]
    report.hooks_called |= set(result["hooks_called"])
    report.notes += result["notes"]
    return report
