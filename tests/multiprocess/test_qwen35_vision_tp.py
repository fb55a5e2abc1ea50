"""The Qwen3.5-VL vision tower and patch merger (providers/qwen35/vision.py) split over tensor parallelism: in a
2-process gloo world at encoder TP 2, each rank reads its slices of a tiny random transformers checkpoint through
hf/vision.py's maps (whole heads of the regrouped qkv, halves of the MLPs) and the two ranks together give
transformers' merged tokens for packed images, within 1e-4 fp32."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve()
UNIT = SCRIPT.parent.parent / "unit"
TOLERANCE = 1e-4


def test_tensor_parallel_tower_matches_the_reference(tmp_path):
    sys.path.insert(0, str(UNIT))
    from test_qwen35_vision import IMAGE_SIZES, TINY_TEXT, TINY_VISION, _randomize
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from helpers import torchrun_world

    from mimo.providers.qwen35.vision import Qwen35VisionSettings

    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TINY_TEXT, vision_config=TINY_VISION)).eval()
    _randomize(model.model.visual, seed=0)
    model.save_pretrained(tmp_path / "hf")
    mode = Qwen35VisionSettings(patch_size=4, min_pixels=16 * 16, max_pixels=64 * 64,
                                vision_out_hidden_size=48).image_mode()
    gen = torch.Generator().manual_seed(1)
    inputs = mode.collate([mode.process(torch.rand(3, h, w, generator=gen)) for h, w in IMAGE_SIZES])
    with torch.no_grad():
        want = model.model.visual(inputs["pixel_values"], grid_thw=inputs["grid_thw"]).pooler_output
    torch.save(inputs, tmp_path / "inputs.pt")
    torchrun_world(_main, (tmp_path,), 2)  # as torchrun --nproc-per-node 2 runs this file
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        error = float((got["tokens"] - want).abs().max() / want.abs().max())
        assert got["tokens"].shape == want.shape and error <= TOLERANCE, (rank, error)
        assert got["qkv_rows"] == 3 * 32 // 2 and got["fc1_rows"] == 4 * 32 // 2  # each rank holds half


def _main(folder: Path) -> None:
    import json

    import torch.distributed as dist
    from megatron.core.transformer.spec_utils import build_module

    from mimo.core.checkpoint.hf_load import load_into
    from mimo.core.config import LayoutOptions
    from mimo.core.parallel import layout, topology
    from mimo.core.run import cpu_redirect
    from mimo.core.run.launch import seed_everything
    from mimo.plugins import LANGUAGE, BuildContext, ModuleShape
    from mimo.plugins.kit.safetensors_io import FolderSource
    from mimo.providers.qwen35.hf import vision as hf_vision
    from mimo.providers.qwen35.vision import Qwen35VisionSettings, merger_spec, tower_spec

    cpu_redirect.enable()
    dist.init_process_group("gloo")
    hf_config = json.loads((folder / "hf" / "config.json").read_text())
    s = Qwen35VisionSettings(**hf_vision.config_fields(hf_config["vision_config"]))
    shapes = {"images": ModuleShape(s.vision_depth, s.vision_hidden_size, s.vision_heads,
                                    num_query_groups=s.vision_heads),
              LANGUAGE: ModuleShape(1, s.vision_out_hidden_size, 2, num_query_groups=2)}
    parallelism = layout.plan(LayoutOptions(encoder_tp=2, llm_tp=2), 2, shapes, micro_batch_size=1)
    topo = topology.build(parallelism, backend="gloo")
    rank = dist.get_rank()
    seed_everything(0, tp_rank=rank, ep_rank=0, etp_rank=0)
    ctx = BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)
    tower = build_module(tower_spec(s, ctx, "images")).eval()
    merger = build_module(merger_spec(s, ctx, "images")).eval()
    metadata = {"dp_cp_group": topo.pg_collections["images"].dp_cp}
    with FolderSource(folder / "hf") as source:
        for module, tmap in ((tower, hf_vision.tower_map(s)), (merger, hf_vision.merger_map(s))):
            _, initial, errors = load_into(module, [(tmap.prefixed("", "model.visual."), source)], metadata)
            assert not initial and not errors, (initial, errors)
    inputs = torch.load(folder / "inputs.pt")
    with torch.no_grad():
        tokens = merger(tower(**inputs))
    torch.save({"tokens": tokens, "qkv_rows": tower.decoder.layers[0].self_attention.linear_qkv.weight.shape[0],
                "fc1_rows": merger.encoder.linear_fc1.weight.shape[0]}, folder / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
