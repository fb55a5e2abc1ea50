"""Checkpoints across library releases: torch 2.15's checkpoint metadata is read, a run resumed with a longer
--train-iters equals an uninterrupted one, and whatever a library raises while loading is one line."""

import pickle

import pytest

from helpers import run_mimo
from test_checkpoint import BASE, losses, train

pytestmark = pytest.mark.smoke


def rewrite_tensor_properties(checkpoint, change) -> int:
    """Apply `change` to the TensorProperties of every tensor in the checkpoint's torch metadata file."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = checkpoint / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    tensors = [meta for meta in metadata.state_dict_metadata.values() if isinstance(meta, TensorStorageMetadata)]
    for meta in tensors:
        change(meta.properties)
    path.write_bytes(pickle.dumps(metadata))
    return len(tensors)


def test_resuming_with_a_larger_train_iters_equals_an_uninterrupted_run(tmp_path):
    """The commands a user runs: save after 2 iterations, then resume to 4 (a constant schedule has no length)."""
    save = tmp_path / "save"
    train(tmp_path, "first", "--train-iters", "2", "--save", str(save))
    resumed, result = train(tmp_path, "resumed", "--train-iters", "4", "--load", str(save), "--save", str(save))
    full, _ = train(tmp_path, "full", "--train-iters", "4")
    assert "resumed from" in result.stdout
    assert losses(resumed) == {i: loss for i, loss in losses(full).items() if i > 2}  # exact equality
    # A decaying schedule does have a length: changing it is refused, naming the way out.
    _, refused = train(tmp_path, "decay", "--train-iters", "4", "--load", str(save), "--lr-decay-style", "cosine",
                       ok=False)
    assert refused.returncode == 2 and "--no-load-scheduler" in refused.stderr


def test_tensor_metadata_with_the_strides_field_of_torch_2_15():
    """torch 2.15 gave TensorProperties a `strides` field; megatron-core 0.19.2 passes every field to torch.empty
    (TypeError), which broke every mimo load. mimo's strategy reads shape and dtype alone. Under torch 2.15 every
    resume test checks this end to end (scripts/test-latest.sh); here the field is set by hand on any release."""
    from pathlib import Path

    import torch
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata,
    )

    from mimo.plugins.kit.dist_checkpoint import TorchDistLoadStrategy

    properties = TensorProperties(dtype=torch.bfloat16)
    properties.strides = (3, 1)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3]))
    metadata = Metadata(state_dict_metadata={"w": TensorStorageMetadata(properties, torch.Size([2, 3]), [chunk])})
    with pytest.raises(TypeError, match="strides"):  # megatron-core's own strategy: the break itself
        TorchDistLoadShardedStrategy().load_tensors_metadata(Path("unused"), metadata)
    described = TorchDistLoadStrategy().load_tensors_metadata(Path("unused"), metadata)
    assert described["w"].global_shape == (2, 3) and described["w"].dtype == torch.bfloat16


def test_an_unreadable_checkpoint_is_one_line_whatever_the_library_raises(tmp_path):
    """Metadata whose dtype no torch release can read: the load fails inside the libraries (a TypeError, which no
    list of expected errors names); the user gets one line naming the checkpoint and the error, exit 2."""
    save = tmp_path / "save"
    train(tmp_path, "a", "--train-iters", "2", "--save", str(save))
    rewrite_tensor_properties(save / "iter_0000002", lambda properties: setattr(properties, "dtype", "float32"))
    for how in (("--load", str(save)), ("--pretrained", str(save))):
        result = run_mimo(*BASE, "--train-iters", "3", *how)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-3000:]
        assert f"checkpoint {save / 'iter_0000002'} cannot be loaded (TypeError: " in result.stderr
