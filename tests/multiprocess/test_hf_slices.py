"""Each rank reads only its slices of a Hugging Face folder (core/checkpoint/hf_load.py with the pread reader of
mimo.plugins.kit.safetensors_io): in a 2-process gloo world at --llm-tp 2 --encoder-tp 2 (a dense tiny LLM and a
RADIO, as parts), every rank's reader delivers exactly the bytes of the tensors its shards hold, reads a tensor
whole only where the rank holds all of it, and overwrites every tensor of a poisoned (NaN) model. A reader that
reads whole tensors and slices them afterwards fails the same check."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve()


def test_each_rank_reads_its_slices_and_nothing_more(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    from helpers import torchrun_world
    from hf_models import DENSE_TEXT, save_llm, save_radio

    llm, radio = save_llm(tmp_path / "llm", DENSE_TEXT), save_radio(tmp_path / "radio")
    torchrun_world(_main, (str(llm), str(radio), tmp_path), 2)  # as torchrun --nproc-per-node 2 runs this file
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["errors"] == [] and record["nan_left"] == [], record
        assert record["read"] == record["slices"] > 0, record  # exactly its slices
        assert record["whole_not_held"] == [], record
        assert record["slices"] < record["whole_model"] * 0.7  # TP2: about half of each sharded tensor
        assert record["whole_reader_caught"], record  # the check fails a reader that reads whole tensors


def _check(model, sources, reader_class) -> dict:
    """Poison this rank's tensors, load them through `reader_class`, and account for what was read."""
    import torch

    from mimo.core.checkpoint.hf_load import load_into, rank_tensors
    from mimo.plugins.kit.tensor_map import leaves

    readers = [(tmap, reader_class(folder)) for _, folder, tmap in sources]
    held = [(key, sh) for key, sh in rank_tensors(model) if any(key in tmap.tensors for tmap, _ in readers)]
    with torch.no_grad():
        for _, sh in held:
            if sh.data.is_floating_point():
                sh.data.fill_(float("nan"))
    _, _, errors = load_into(model, readers)
    slices, whole_ok = 0, set()
    for key, sh in held:
        tmap, reader = next((t, r) for t, r in readers if key in t.tensors)
        names = {leaf.name for leaf in leaves(tmap.tensors[key])}
        slices += sh.data.numel() * reader.dtype(next(iter(names))).itemsize
        if all(n == 1 for n in sh.axis_fragmentations[sh.prepend_axis_num:]):  # the rank holds the item whole
            whole_ok |= names
    read = sum(r.meter.bytes for _, r in readers)
    whole = {n for _, r in readers for n in r.meter.whole}
    return {"errors": errors, "read": read, "slices": slices, "whole_not_held": sorted(whole - whole_ok),
            "nan_left": [key for key, sh in held if sh.data.is_floating_point() and sh.data.isnan().any()],
            "whole_model": sum(sum(os.path.getsize(p) for p in Path(folder).glob("*.safetensors"))
                               for _, folder, _ in sources)}


def _main(llm: str, radio: str, out: Path) -> None:
    import torch.distributed as dist

    from mimo.core.checkpoint.hf import hf_sources_of
    from mimo.core.config import CheckpointOptions, LayoutOptions, RunConfig, TrainingOptions
    from mimo.core.run.plan import prepare
    from mimo.core.run.world import join
    from mimo.plugins.kit.safetensors_io import FolderSource

    class WholeReader(FolderSource):
        """Reads every requested tensor whole, then copies the slice out (what mmap-free readers often do)."""

        def read_into(self, name, index, out):
            whole = tuple((0, n) for n in self.shape(name))
            tensor = torch.empty(self.shape(name), dtype=self.dtype(name))
            super().read_into(name, whole, tensor)
            out.copy_(tensor[tuple(slice(a, b) for a, b in index)])

    import torch

    config = RunConfig(provider="nemotron-moe-vlm-tiny", provider_settings=["projection=mlp", "projection_norm=true"],
                       layout=LayoutOptions(llm_tp=2, encoder_tp=2),
                       checkpoint=CheckpointOptions(pretrained_llm=Path(llm), pretrained_vision=Path(radio)),
                       training=TrainingOptions(micro_batch_size=1, train_iters=1, precision="fp32", device="cpu"))
    plan = prepare(config, world_size=2)
    world = join(plan)
    model = world.build_model()
    sources = hf_sources_of(plan)
    record = _check(model, sources, FolderSource)
    whole = _check(model, sources, WholeReader)
    record["whole_reader_caught"] = whole["read"] != whole["slices"] and not whole["errors"]
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
