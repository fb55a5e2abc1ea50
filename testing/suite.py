"""`ProviderContract`: the contract as pytest tests, one per rule, for a provider package's own test suite.

    from mimo.testing import ProviderContract

    class TestMyVLM(ProviderContract):
        provider = "my-vlm"
        settings = ("num_layers=1",)   # optional: `--set` strings for a model small enough for CPU

pytest collects the inherited `test_*` methods (the base class's name does not start with "Test", so it is not
collected itself). Nothing here is a pytest plugin: importing it is the opt-in.
"""

from __future__ import annotations

from .data_check import check_data
from .data_path_check import check_data_path
from .flops_check import check_flops, check_sample_flops
from .memory_check import check_module_memory
from .model_check import check_model_shape, check_specs, module_reports, vocab_size
from .report import ContractReport
from .settings_check import check_registration, check_settings_round_trip
from .size_check import check_size_settings
from .subject import Subject, load_subject
from .train_check import CPU_PARAMETER_LIMIT, check_build_and_train, too_large


class ProviderContract:
    provider: str = ""
    settings: tuple[str, ...] = ()
    max_parameters: int = CPU_PARAMETER_LIMIT

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._cache = {}  # per test class: the subject and the static results, computed once

    def _subject(self) -> Subject:
        if not self.provider:
            raise TypeError(f"{type(self).__name__}: set `provider = \"<name>\"` to the provider under test")
        if "subject" not in self._cache:
            self._cache["subject"] = load_subject(self.provider, self.settings)
        return self._cache["subject"]

    def _static(self):
        if "static" not in self._cache:
            subject = self._subject()
            shapes = check_model_shape(subject)
            encoders, language = check_specs(subject, shapes)
            self._cache["static"] = shapes, encoders, language
        return self._cache["static"]

    def _seq_length(self) -> int:
        if "seq_length" not in self._cache:
            _, encoders, language = self._static()
            self._cache["seq_length"] = check_data(self._subject(), encoders, vocab_size(language))
        return self._cache["seq_length"]

    def test_registration(self):
        check_registration(self._subject())

    def test_settings_round_trip(self, tmp_path):
        check_settings_round_trip(self._subject(), tmp_path)

    def test_size_settings(self):
        check_size_settings(self._subject())

    def test_model_shape(self):
        shapes, _, _ = self._static()
        print(ContractReport(self.provider, module_reports(shapes)).summary())

    def test_build_specs(self):
        self._static()

    def test_data(self):
        self._seq_length()

    def test_data_path(self):
        _, encoders, language = self._static()
        note = check_data_path(self._subject(), encoders, vocab_size(language))
        if note:
            print(f"{self.provider}: {note}")

    def test_flops(self):
        import pytest

        shapes, _, _ = self._static()
        flops, note = check_flops(self._subject(), shapes, self._seq_length())
        if note:
            pytest.skip(note)
        print(f"{self.provider}: model_flops = {flops}")
        note = check_sample_flops(self._subject(), flops, self._seq_length())
        if note:
            print(f"{self.provider}: {note}")

    def test_module_memory(self):
        import pytest

        shapes, _, _ = self._static()
        note = check_module_memory(self._subject(), shapes)
        if note:
            pytest.skip(note)

    def test_builds_trains_and_checkpoints(self):
        import pytest

        shapes, _, _ = self._static()
        reason = too_large(shapes, self.max_parameters)
        if reason:
            pytest.skip(reason)
        result = check_build_and_train(self.provider, self.settings)
        print(f"{self.provider}: built {result['built_parameters']}, losses {result['losses']}")
        for note in result["notes"]:
            print(f"note: {note}")
