"""Host memory of loading Hugging Face weights: peak RSS against the checkpoint's size (docs/verification.md).

    python bench/hf_load_memory.py --out results/hf_load_memory --dir /local/scratch     # the few-GB measurement
    python bench/hf_load_memory.py --out /tmp/smoke --quick                            # the script itself, small

Writes a synthetic `nemotron_h` folder in several shards (bf16, random weights, streamed with mimo's ShardWriter:
the bench itself holds one tensor at a time), then, each in a fresh process:

- `load` (world of one) and `load` under `--llm-tp 2` (two processes): mimo's LLM built for that layout with
  nothing trainable (`--pretrained-llm`, the part's settings), the peak RSS reset after the build
  (/proc/self/clear_refs), then the per-rank loader; per rank: the bytes its shards hold, the bytes read, what
  the load added to the peak (VmHWM - VmRSS before), seconds;
- `import-hf`: `mimo ckpt import-hf OUT --llm FOLDER`, the whole process's peak RSS (the model, the load and the
  save) against the checkpoint's size.

Each process drops the folder's pages from the page cache first (posix_fadvise DONTNEED), so reads come from disk.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

FULL = dict(hidden_size=2048, vocab_size=131072, pattern="M*-" * 8, mamba_num_heads=32, mamba_head_dim=64,
            n_groups=8, ssm_state_size=128, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
            intermediate_size=10752, shard="500MB")
QUICK = dict(hidden_size=128, vocab_size=4096, pattern="M*-", mamba_num_heads=4, mamba_head_dim=32, n_groups=2,
             ssm_state_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
             shard="1MB")
TYPES = {"M": "mamba", "*": "attention", "-": "mlp"}


def write_folder(folder: Path, size: dict) -> int:
    """A random bf16 nemotron_h folder; returns its bytes."""
    import torch

    from mimo.plugins.kit.safetensors_io import ShardWriter, write_json
    from mimo.providers.nemotron.hf import nemotron_h

    config = dict(model_type="nemotron_h", architectures=["NemotronHForCausalLM"], dtype="bfloat16",
                  layers_block_type=[TYPES[c] for c in size["pattern"]], conv_kernel=4,
                  **{k: v for k, v in size.items() if k not in ("pattern", "shard")})
    fields = nemotron_h.config_fields(config)
    shapes = _hf_shapes(fields)
    folder.mkdir(parents=True)
    plan = [(name, torch.bfloat16, shape) for name, shape in shapes.items()]
    writer = ShardWriter(folder, plan, _bytes(size["shard"]))
    generator = torch.Generator().manual_seed(0)
    for name, _, shape in plan:
        writer.write(name, (torch.randn(shape, generator=generator) * 0.02).bfloat16())
    writer.finish()
    write_json(folder / "config.json", config)
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _hf_shapes(f: dict) -> dict:
    """Every tensor's shape of a nemotron_h checkpoint of fields `f` (from the provider's map, rows summed)."""
    from mimo.plugins.kit.tensor_map import Cat, Src, Stack

    from mimo.providers.nemotron.hf import nemotron_h

    h, inner = f["hidden_size"], f["mamba_num_heads"] * f["mamba_head_dim"]
    groups = f["mamba_num_groups"] * f["mamba_state_dim"]
    known = {"embeddings.weight": (f["vocab_size"], h), "lm_head.weight": (f["vocab_size"], h),
             "mixer.in_proj.weight": (2 * inner + 2 * groups + f["mamba_num_heads"], h),
             "mixer.conv1d.weight": (inner + 2 * groups, 1, 4), "mixer.conv1d.bias": (inner + 2 * groups,),
             "mixer.out_proj.weight": (h, inner), "mixer.norm.weight": (inner,),
             "mixer.q_proj.weight": (f["num_attention_heads"] * f["kv_channels"], h),
             "mixer.k_proj.weight": (f["num_query_groups"] * f["kv_channels"], h),
             "mixer.v_proj.weight": (f["num_query_groups"] * f["kv_channels"], h),
             "mixer.o_proj.weight": (h, f["num_attention_heads"] * f["kv_channels"]),
             "mixer.up_proj.weight": (f["ffn_hidden_size"], h), "mixer.down_proj.weight": (h, f["ffn_hidden_size"])}
    out = {}
    for spec in nemotron_h.tensor_map(f).tensors.values():
        for leaf in _leaves(spec, Src, Cat, Stack):
            tail = next((k for k in known if leaf.name.endswith(k)), None)
            out[leaf.name] = known[tail] if tail else (f["mamba_num_heads"],) if "mixer." in leaf.name else (h,)
    return out


def _leaves(spec, Src, Cat, Stack):
    if isinstance(spec, Src):
        yield spec
    else:
        for sub in spec.parts if isinstance(spec, Cat) else spec.items:
            yield from _leaves(sub, Src, Cat, Stack)


def _bytes(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    return int(float(text[:-2]) * units[text[-2:]])


def drop_cache(folder: Path) -> None:
    for path in folder.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def load_case(folder: Path, out: Path, tp: int) -> None:
    """In each process of the case: build the LLM for the layout, reset the peak, load, record."""
    import torch.distributed as dist

    from mimo.core.checkpoint.hf import hf_sources_of
    from mimo.core.checkpoint.hf_load import load_hf
    from mimo.core.config import CheckpointOptions, LayoutOptions, RunConfig, TrainingOptions
    from mimo.core.run.plan import prepare
    from mimo.core.run.world import join

    config = RunConfig(provider="nemotron-moe-vlm-tiny", layout=LayoutOptions(llm_tp=tp, encoder_tp=tp),
                       checkpoint=CheckpointOptions(pretrained_llm=folder),
                       training=TrainingOptions(micro_batch_size=1, train_iters=1, precision="bf16", device="cpu"))
    plan = prepare(config, world_size=tp)
    world = join(plan)
    model = world.build_model(trainable=False)
    held = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("language_model"))
    drop_cache(folder)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_kib("VmRSS")
    started = time.perf_counter()
    sources = hf_sources_of(plan)
    load_hf(model, sources)
    seconds = time.perf_counter() - started
    record = {"case": f"load tp{tp}", "rank": dist.get_rank(), "held_bytes": held,
              "load_added_bytes": (status_kib("VmHWM") - before) * 1024, "seconds": round(seconds, 2)}
    (out / f"load-tp{tp}-rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: under --out)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)  # FOLDER OUT TP: one load case's process
    args = parser.parse_args()
    if args.case:
        load_case(Path(args.case[0]), Path(args.case[1]), int(args.case[2]))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = (args.dir or args.out) / "hf-load-memory"
    shutil.rmtree(scratch, ignore_errors=True)
    folder = scratch / "nemotron_h"
    size = write_folder(folder, QUICK if args.quick else FULL)
    shards = len(list(folder.glob("*.safetensors")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1"}
    drop_cache(folder)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mimo.cli", "ckpt", "import-hf", str(scratch / "imported"), "--llm",
                    str(folder)], check=True, env=env, capture_output=True, text=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the only child so far: the import
    records = [{"case": "import-hf", "peak_rss_bytes": peak, "seconds": round(time.perf_counter() - started, 1)}]
    shutil.rmtree(scratch / "imported")
    for tp in (1, 2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-port",
                   str(29400 + tp), __file__, "--out", str(args.out), "--case", str(folder), str(args.out), str(tp)]
        subprocess.run(command, check=True, env=env, capture_output=True, text=True)
        for rank in range(tp):
            records.append(json.loads((args.out / f"load-tp{tp}-rank{rank}.json").read_text()))
    result = {"checkpoint_bytes": size, "shards": shards, "records": records}
    (args.out / "hf_load_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
