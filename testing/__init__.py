"""Contract tests for mimo providers, the built-in ones and any third party's.

    from mimo.testing import check_provider
    print(check_provider("my-vlm", ["num_layers=1"]).summary())   # raises ContractError("hook: rule")

or, in a provider package's tests, `class TestMyVLM(ProviderContract): provider = "my-vlm"`. See
docs/provider-guide.md ("Testing a provider"). What moved in mimo's API, and which old paths still work, is in
`mimo.testing.moved` (`MOVED`); the report notes each moved path a provider imports.
"""

from .contract import check_provider
from .data_check import check_data, check_layout_independence, check_micro_batch
from .data_path_check import check_data_path
from .data_source_check import check_capabilities, check_data_source
from .flops_check import check_flops, check_sample_flops
from .memory_check import check_module_memory
from .moved import MOVED, moved_imports
from .model_check import check_model_shape, check_specs
from .report import ContractError, ContractReport, ModuleReport
from .settings_check import check_registration, check_settings_round_trip
from .size_check import check_size_settings
from .subject import Subject, builtin_provider_names, hookspec_signatures, load_subject
from .suite import ProviderContract
from .train_check import CPU_PARAMETER_LIMIT, check_build_and_train

__all__ = [
    "CPU_PARAMETER_LIMIT", "MOVED", "ContractError", "ContractReport", "ModuleReport", "ProviderContract", "Subject",
    "builtin_provider_names", "check_build_and_train", "check_capabilities", "check_data", "check_data_path",
    "check_data_source", "check_flops", "check_sample_flops",
    "check_layout_independence", "check_micro_batch", "check_model_shape", "check_module_memory", "check_provider",
    "check_registration",
    "check_settings_round_trip", "check_size_settings", "check_specs", "hookspec_signatures", "load_subject",
    "moved_imports",
]
