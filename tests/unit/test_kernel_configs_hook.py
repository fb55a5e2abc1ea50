"""Which Triton kernels a GPU run pins and records is the provider's to say (hook `kernel_configs`, a
KernelConfigs of modules and tables; a plain list of tables, the hook's first form, tunes the modules its kernels
are named after); the loop names no kernel package itself, and the contract kit refuses a table whose kernels no
declared module holds."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

from mimo.core.config import CompileOptions
from mimo.core.run import compilation, kernel_tuning
from mimo.plugins import KernelConfigs
from mimo.testing.kernel_configs_check import check_kernel_configs
from mimo.testing.report import ContractError

from test_gpu_speed_options import _autotuned

GPU = ("NVIDIA H100 80GB HBM3", "9.0")


def _module(monkeypatch, name: str):
    """A kernel module as mamba-ssm's are: a module attribute that is a Triton Autotuner."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.scale = _autotuned()
    monkeypatch.setitem(sys.modules, name, module)
    return module.scale


def _table(tuner) -> dict:
    row = {"key": [8192, "torch.bfloat16"], "config": kernel_tuning.config_dict(tuner.configs[1])}
    return {"gpu": GPU[0], "capability": GPU[1], "triton": "3.6.0", "kernels": {"declared_kernels.scale": [row]}}


class _Hooks:
    def __init__(self, returned):
        self.returned = returned

    def kernel_configs(self, settings):
        return self.returned


def test_kernel_configs_of_each_form():
    assert KernelConfigs.of(None) == KernelConfigs(())
    table = {"gpu": "g", "kernels": {"a.b.k1": [], "a.b.k2": [], "c.k3": []}}
    assert KernelConfigs.of([table]) == KernelConfigs(("a.b", "c"), (table,))
    declared = KernelConfigs(("x",), (table,))
    assert KernelConfigs.of(declared) is declared


@pytest.mark.parametrize("form", ["record", "list"])
def test_the_run_pins_and_records_the_modules_the_provider_names(monkeypatch, tmp_path, form):
    declared = _module(monkeypatch, "declared_kernels")
    other = _module(monkeypatch, "other_kernels")  # a kernel module the provider does not name: left alone
    table = _table(declared)
    returned = KernelConfigs(("declared_kernels",), (table,)) if form == "record" else [table]
    monkeypatch.setattr(compilation, "_gpu", lambda device: GPU)
    first = compilation.FirstIterations(CompileOptions(compile_cache=tmp_path), hooks=_Hooks(returned),
                                        settings=None, device=torch.device("cuda"), speaks=False)
    first.before(1)
    try:
        assert first.tuners == {"declared_kernels.scale": declared} and first.pinned == 1
        assert declared.cache[(8192, "torch.bfloat16")] is declared.configs[1] and not other.cache
    finally:
        first.close()
    recorded = kernel_tuning.read_table(tmp_path / compilation.TABLE_FILE)
    assert list(recorded["kernels"]) == ["declared_kernels.scale"]


class _Subject:
    settings = None

    def __init__(self, returned):
        self.returned = returned

    def call(self, name, **kwargs):
        return self.returned


def test_the_kit_refuses_tables_of_undeclared_modules_and_other_returns():
    table = {"gpu": "g", "kernels": {"declared_kernels.scale": [{"key": [1], "config": {"kwargs": {}}}]}}
    assert check_kernel_configs(_Subject(KernelConfigs(("declared_kernels",), (table,)))) is None
    assert check_kernel_configs(_Subject([table])) is None  # the hook's first form
    with pytest.raises(ContractError, match="declared_kernels.scale: its module is not among KernelConfigs.modules"):
        check_kernel_configs(_Subject(KernelConfigs(("other_kernels",), (table,))))
    with pytest.raises(ContractError, match="must return a mimo.plugins.KernelConfigs"):
        check_kernel_configs(_Subject({"tables": [table]}))
