"""Nemotron-format checkpoints (providers/nemotron/checkpoint.py): a tiny model saved in Nemotron's layout loads
strictly into another, in one process and into a heterogeneous two-process layout; a checkpoint lacking one key
the model needs fails on every rank with an error naming it.

dist_checkpointing's saver starts a helper process, so the work runs in processes of its own (forked from the
tests' command server, helpers.torchrun_world): this file is also the script
(`python tests/multiprocess/test_nemotron_checkpoint.py single|split DIR`), which writes what it saw to DIR.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve()
MISSING_KEY = "vision_projection.encoder.weight"  # the affine projection's one linear layer


def _run(mode: str, out: Path, nproc: int = 1):
    from helpers import torchrun_world  # here: the file also runs as a script, without tests/ on sys.path

    torchrun_world(_main, (mode, out), nproc)  # as torchrun --nproc-per-node NPROC runs this file


@pytest.mark.smoke
def test_nemotron_checkpoints_load_strictly_in_any_layout(tmp_path):
    _run("single", tmp_path)
    single = json.loads((tmp_path / "single-0.json").read_text())
    # Nemotron's prefixes; inside them TE's names (fused norms, conv1d) and megatron-core's checkpoint layout
    # (Mamba projections split per component, the ViT's layers stacked, experts stacked as TEGroupedMLP's are)
    keys = single["checkpoint_keys"]
    assert {k.split(".")[0] for k in keys} == {"language_model", "vision_model", "vision_projection"}
    for key in ("vision_model.class_token", "vision_model.position_embeddings", "vision_model.embedder.weight",
                "vision_model.decoder.layers.self_attention.linear_qkv.layer_norm_bias",
                MISSING_KEY,
                "language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight",
                "language_model.decoder.layers.0.mixer.in_proj.layer_norm_weight",
                "language_model.decoder.layers.0.mixer.conv1d.weight.x",
                "language_model.decoder.layers.0.mixer.in_proj.weight.dt",
                "language_model.decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
                "language_model.decoder.layers.2.pre_mlp_layernorm.weight",
                "language_model.decoder.layers.2.mlp.router.expert_bias",
                "language_model.decoder.layers.2.mlp.experts.experts.linear_fc1.weight",
                "language_model.decoder.layers.2.mlp.shared_experts.linear_fc2.weight",
                "language_model.decoder.final_norm.weight"):
        assert key in keys, key
    assert single["differed_before_load"] and single["equal_after_load"]
    assert single["missing_error"].startswith("Nemotron checkpoint") and MISSING_KEY in single["missing_error"]

    # RADIO and projection on rank 0, the LLM on rank 1, loading what one process saved: same weights.
    _run("split", tmp_path, nproc=2)
    for rank in (0, 1):
        split = json.loads((tmp_path / f"split-{rank}.json").read_text())
        assert split["checksums"] and all(single["checksums"][name] == value
                                          for name, value in split["checksums"].items())
        assert {name.split(".")[0] for name in split["checksums"]} == {("modality_submodules", "language_model")[rank]}
        # the missing key belongs to rank 0's module; rank 1 raises the same error rather than hang
        assert MISSING_KEY in split["missing_error"]


# ------------------------------------------------------------------------------------------ the script


def _build(seed: int, encoder_ranks: int):
    import torch
    from megatron.core.models.mimo import MimoModel, MimoModelConfig
    from mimo.core.parallel import layout, topology
    from mimo.core.config import LayoutOptions
    from mimo.core.run.launch import seed_everything
    from mimo.plugins import BuildContext
    from mimo.providers import nemotron

    settings = nemotron.NemotronVLMSettings(**{**nemotron.TINY, "projection": "affine"})  # Megatron-LM's recipe
    parallelism = layout.plan(LayoutOptions(encoder_ranks=encoder_ranks), torch.distributed.get_world_size(),
                                nemotron.model_shape(settings), micro_batch_size=1)
    topo = topology.build(parallelism, backend="gloo")
    seed_everything(seed, tp_rank=0, ep_rank=0, etp_rank=0)
    ctx = BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)
    encoder = nemotron.build_encoders(settings, ctx)[nemotron.IMAGES]
    return MimoModel(MimoModelConfig(
        language_model_spec=nemotron.build_language_model(settings, ctx),
        modality_submodules_spec={nemotron.IMAGES: encoder.spec},
        special_token_ids={nemotron.IMAGES: encoder.placeholder_token_id}, module_to_grid_map=topo.grids))


def _weights(model) -> dict:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _missing_error(model, directory) -> str:
    from mimo.providers.nemotron.checkpoint import MissingCheckpointKeys, load_nemotron_checkpoint

    try:
        load_nemotron_checkpoint(model, directory)
    except MissingCheckpointKeys as err:
        return str(err)
    return "no error"


def _main(mode: str, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from mimo.core.run.launch import init_process
    from mimo.plugins.kit.dist_checkpoint import saved_tensor_shapes
    from mimo.providers.nemotron.checkpoint import (
        load_nemotron_checkpoint, nemotron_sharded_state_dict, save_nemotron_checkpoint,
    )

    init_process("cpu")
    rank, report = dist.get_rank(), {}
    if mode == "single":
        source, target = _build(seed=1, encoder_ranks=0), _build(seed=2, encoder_ranks=0)
        (out / "full").mkdir()
        save_nemotron_checkpoint(source, out / "full")
        # the same checkpoint without one key, written through dist_checkpointing directly
        state = nemotron_sharded_state_dict(source)
        (out / "partial").mkdir()
        dist_checkpointing.save({k: v for k, v in state.items() if v.key != MISSING_KEY}, str(out / "partial"))
        expected, before = _weights(source), _weights(target)
        report["differed_before_load"] = any(not torch.equal(before[n], expected[n]) for n in expected)
        load_nemotron_checkpoint(target, out / "full")
        after = _weights(target)
        report["equal_after_load"] = all(torch.equal(after[n], expected[n]) for n in expected)
        report["checkpoint_keys"] = sorted(saved_tensor_shapes(out / "full"))
        report["missing_error"] = _missing_error(_build(seed=3, encoder_ranks=0), out / "partial")
    else:
        target = _build(seed=2, encoder_ranks=1)
        load_nemotron_checkpoint(target, out / "full")
        report["missing_error"] = _missing_error(target, out / "partial")
    report["checksums"] = {name: float(p.double().sum()) + float(p.double().abs().sum())
                           for name, p in target.named_parameters()}
    (out / f"{mode}-{rank}.json").write_text(json.dumps(report))
    dist.barrier()


if __name__ == "__main__":
    _main(sys.argv[1], Path(sys.argv[2]))
