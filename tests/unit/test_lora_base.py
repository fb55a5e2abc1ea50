"""What a LoRA checkpoint records of its base, without training: the base's fingerprint tells new weights of the
same shapes apart (not a copy elsewhere, not a download tool's bookkeeping), the recorded base is taken only while
it is there and unchanged (one line naming what changed otherwise), records of older checkpoints still verify."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from mimo.core.checkpoint import adapter_state
from mimo.core.checkpoint.layout import TRACKER
from mimo.core.config import CheckpointOptions
from mimo.errors import UsageError


def _hf_folder(path, seed: int):
    """A Hugging Face-like folder: a config and 4 MiB of weights (above the size read whole)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "x"}')
    weights = torch.randn(1 << 20, generator=torch.Generator().manual_seed(seed))
    save_file({"w": weights}, str(path / "model.safetensors"))
    return path


def _save_dir(path, iteration: int, payload: bytes):
    """A mimo save directory whose tracker names `iteration`, its shard summed in checksums.json."""
    folder = path / f"iter_{iteration:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__0_0.distcp").write_bytes(payload)
    (folder / "checksums.json").write_text(f'{{"__0_0.distcp": "{hash(payload) & 0xffffffff:08x}"}}')
    (path / TRACKER).write_text(f"{iteration}\n")
    return path


def _record(**folders) -> dict:
    return adapter_state.base_record(CheckpointOptions(**folders), seed=3)


def test_the_fingerprint_tells_new_weights_of_the_same_shapes_apart(tmp_path):
    base = _hf_folder(tmp_path / "base", seed=0)
    before, before_v1 = adapter_state.checksum(base), adapter_state.checksum(base, version=1)
    _hf_folder(base, seed=1)  # a fine-tuned export into the same folder: same names, sizes and header
    assert adapter_state.checksum(base, version=1) == before_v1  # what version 1 could not see
    assert adapter_state.checksum(base) != before
    copy = shutil.copytree(base, tmp_path / "copy")  # another path, other times: the same weights
    (copy / ".cache" / "huggingface").mkdir(parents=True)
    (copy / ".cache" / "huggingface" / "x.metadata").write_text("downloaded at some time")
    assert adapter_state.checksum(copy) == adapter_state.checksum(base)


def test_the_recorded_base_is_taken_while_it_holds_the_same_weights(tmp_path):
    base = _hf_folder(tmp_path / "base", seed=0)
    record = _record(pretrained=base)
    assert record["folders"]["pretrained"]["fingerprint"] == adapter_state.FINGERPRINT
    assert adapter_state.recorded_base(record, tmp_path / "adapters") == {"pretrained": base.resolve()}
    assert adapter_state.base_status(record).startswith("it is unchanged since")

    _hf_folder(base, seed=1)
    with pytest.raises(UsageError, match=r"is not the base the adapters in .* were trained on: it has changed "
                                         r"since \(fingerprint [0-9a-f]{16} now, [0-9a-f]{16} then\)") as err:
        adapter_state.recorded_base(record, tmp_path / "adapters")
    assert "\n" not in str(err.value)

    shutil.rmtree(base)
    with pytest.raises(UsageError, match=r"trained on --pretrained .*base, which is no longer there: give "
                                         r"--pretrained PATH holding those weights"):
        adapter_state.recorded_base(record, tmp_path / "adapters")
    assert adapter_state.base_status(record) == "it is no longer there"


def test_a_mimo_base_trained_on_since_names_both_iterations(tmp_path):
    base = _save_dir(tmp_path / "base", 3, b"weights")
    record = _record(pretrained=base)
    assert record["folders"]["pretrained"]["iteration"] == 3
    assert adapter_state.describe(record) == f"--pretrained {base.resolve()} (iteration 3)"
    _save_dir(base, 4, b"other weights")
    with pytest.raises(UsageError, match="it now holds iteration 4, not 3; give --pretrained a folder"):
        adapter_state.recorded_base(record, tmp_path / "adapters")
    other = _save_dir(tmp_path / "other", 3, b"other weights")  # the same iteration, other shards
    with pytest.raises(UsageError, match=r"--pretrained .*other is not the base .* \(they were trained on "):
        adapter_state.check_base(record, CheckpointOptions(pretrained=other), 3, tmp_path / "adapters")


def test_records_of_older_checkpoints_still_verify(tmp_path):
    """Records without a fingerprint version were taken by version 1 (names, sizes, headers): checked as such."""
    base = _hf_folder(tmp_path / "base", seed=0)
    old = {"folders": {"pretrained": {"path": str(base.resolve()),
                                      "checksum": adapter_state.checksum(base, version=1)}}, "seed": None}
    assert adapter_state.recorded_base(old, tmp_path / "adapters") == {"pretrained": base.resolve()}
    assert adapter_state.describe(old) == f"--pretrained {base.resolve()}"
