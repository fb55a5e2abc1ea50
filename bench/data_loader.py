"""Data loading against training: how fast the lane loader makes packed micro-batches, and how that compares with
the rate training consumes them in the bench config (bench/throughput.py's cases).

    python bench/data_loader.py --out results/data_loader --workers 1 2          # on a CPU (docs/benchmarks.md (e))
    python bench/data_loader.py --out results/data_loader --workers 1 2 4 --no-unpacked --seconds 20 --train  # GPU
    python bench/data_loader.py --out /tmp/smoke --quick                          # the script itself, tiny

Data: a crude-webdataset chat dataset (LLaVA-style JSON, one photo-like 375-1024 px JPEG per sample, 1-3 rounds
of text), written with webdataset's ShardWriter and prepared with energon's own `energon prepare`; `--data DIR`
keeps it (written once). Each case reads it through its provider's `data_provider` hook (`energon_batches`: the
encoder, template, image mode and shuffle buffer training uses), one LLM lane, per worker count, packing on and
off. A row is one `seq_length` sequence (packed: several samples). CPU s/row is the CPU time of the workers and of
this process (which batches, as training's does) per row: it moves much less than the rates when others share
the cores.

Training's rate: rows/s = tokens/s/GPU / seq_length of docs/benchmarks.md (a) (one H100, synthetic data, no
packing). `--train` also measures it here: the case's `mimo run` on the dataset, packing on, with the most workers
given; rows/s from its ms/iter (with packing its tokens/s counts micro-batch-size times too many tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import random
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path

from common import Results, mimo_run, steady
from throughput import CASES, QUICK_CASES, case_args

# tokens/s/GPU of docs/benchmarks.md (a), one H100 80GB, bf16, torch 2.11.0+cu130, megatron-core 0.19.2.
RECORDED_TOKENS_PER_S = {"dense": 29_142, "nemotron-mid": 8_108}
PHOTO_SIZES = [(640, 480), (480, 640), (640, 427), (500, 375), (800, 600), (1024, 768), (640, 640)]  # COCO-like
WORDS = ("the a of and to in is on with that for at by this it from as are its be or an two three small large left "
         "right near behind front background man woman child dog cat car street table window tree sky water people "
         "sitting standing holding looking wearing red blue green white black yellow wooden light building picture "
         "image shows appears there some which while color several bright dark open old new next other").split()


# -- the dataset ---------------------------------------------------------------------------------------------------

def photo(rng: random.Random, width: int, height: int) -> bytes:
    """A JPEG with what makes real photos cost to decode and compress: gradients, soft shapes, sensor noise."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    top, bottom = (np.array([rng.randrange(256) for _ in range(3)], dtype=np.float32) for _ in range(2))
    fade = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    image = Image.fromarray(np.broadcast_to(top * (1 - fade) + bottom * fade, (height, width, 3)).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(3, 12)):
        x, y = rng.randrange(width), rng.randrange(height)
        w, h = rng.randint(width // 16 + 1, width // 2 + 1), rng.randint(height // 16 + 1, height // 2 + 1)
        colour = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x - w, y - h, x + w, y + h), fill=colour)
    pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(3)), dtype=np.float32)
    pixels += np.random.default_rng(rng.randrange(2**32)).normal(0, 6, pixels.shape).astype(np.float32)
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def words(rng: random.Random, low: int, high: int, scale: float = 1.0) -> str:
    """Log-uniformly many words: most turns short, some long, as in instruction-tuning data."""
    count = max(1, round(scale * math.exp(rng.uniform(math.log(low), math.log(high)))))
    return " ".join(rng.choice(WORDS) for _ in range(count)).capitalize() + "."


def write_chat_dataset(path: Path, num_samples: int, seed: int = 0, scale: float = 1.0) -> None:
    """`num_samples` LLaVA-style chats, one photo each, prepared with `energon prepare`; `scale` shrinks the photos'
    sides and the turns' lengths (--quick: the tiny models' sequences must still hold a prompt and an answer)."""
    import webdataset as wds
    from megatron.energon.tools.prepare import command as energon_prepare

    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(path / "shard-%04d.tar"), maxcount=100, verbose=0) as sink:
        for i in range(num_samples):
            turns = []
            for r in range(rng.randint(1, 3)):
                turns += [{"from": "human", "value": ("<image>\n" if r == 0 else "") + words(rng, 5, 40, scale)},
                          {"from": "gpt", "value": words(rng, 10, 250, scale)}]
            width, height = rng.choice(PHOTO_SIZES)
            sink.write({"__key__": f"chat{i:06d}", "json": {"conversations": turns},
                        "jpg": photo(rng, max(16, int(width * scale)), max(16, int(height * scale)))})
    with contextlib.redirect_stdout(io.StringIO()):  # it prints a sample and its guesses about the fields
        energon_prepare.main([str(path), "--non-interactive", "--split-ratio", "1,0,0", "--sample-type",
                              "CrudeWebdataset", "--no-progress", "--num-workers", "1"], standalone_mode=False)


# -- the loader ----------------------------------------------------------------------------------------------------

def case_settings(case):
    """(the provider's hooks, its settings object) for a bench/throughput.py case, as `mimo run --set` builds it."""
    from mimo.plugins import Registry
    from mimo.plugins.settings import build_settings

    registry = Registry()
    return registry.hooks(case[0]), build_settings(registry.get(case[0])[0], [f"{k}={v}" for k, v in case[1].items()])


def batch_figures(batch: dict, keys: list[str], pad_id: int, patch_size: int) -> dict:
    """What one micro-batch carries: samples, rows, real (non-padding) tokens, loss tokens, image patches."""
    packed = "packing_kwargs" in batch
    encoders = next(iter(batch["modality_inputs"].values()), {})
    x = next(iter(encoders.values()))["x"] if encoders else None
    if x is None:
        patches = 0
    elif x.ndim == 4:  # fixed tiles: [images, 3, H, W], (H/P)^2 patches each
        patches = x.shape[0] * (x.shape[2] // patch_size) * (x.shape[3] // patch_size)
    else:  # dynamic resolution: one [1, patches, C*P*P] buffer
        patches = x.shape[1]
    return {"samples": sum(key.count(",") + 1 for key in keys),  # a packed row's key joins its samples' keys
            "rows": len(keys),
            # packed: the real lengths' sum; not packed: what is not padding (exact for the byte tokenizer)
            "real_tokens": int(batch["packing_kwargs"]["cu_seqlens_q"][-1]) if packed else
            int((batch["input_ids"] != pad_id).sum()),
            "loss_tokens": int(batch["loss_mask"].sum()), "patches": patches}


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds so far of (this process, its children: the loader's workers), from Linux's /proc: what the
    loader costs whatever else shares the cores, unlike its rate."""
    main, workers, me = 0.0, 0.0, str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        main, workers = (main + seconds, workers) if pid == me else (main, workers + seconds * (fields[1] == me))
    return main, workers


def measure_loader(name: str, case, path: Path, workers: int, pack: bool, seconds: float, packing_buffer: int,
                   recorded_tokens_s: float | None) -> dict:
    """The provider's loader for one lane: its first micro-batch, then the steady state for `seconds`."""
    from mimo.plugins import DataContext

    hooks, settings = case_settings(case)
    ctx = DataContext(micro_batch_size=case[2], num_microbatches=1, num_lanes=1, seed=0, data_path=str(path),
                      num_workers=workers, pack_sequences=pack, packing_buffer_size=packing_buffer)
    loader = hooks.data_provider(settings=settings, ctx=ctx)
    pad_id = loader.task_encoder.tokenizer.pad_id
    totals = dict(samples=0, rows=0, real_tokens=0, loss_tokens=0, patches=0)
    try:
        start = time.perf_counter()
        next(loader)
        first = time.perf_counter() - start
        for _ in range(2 * workers):  # every worker has filled its shuffle and packing buffers
            next(loader)
        batches, start, cpu = 0, time.perf_counter(), cpu_seconds()
        while time.perf_counter() - start < seconds or batches < 3:
            figures = batch_figures(next(loader), [row[3] for row in loader.last_rows], pad_id, settings.patch_size)
            for key, value in figures.items():
                totals[key] += value
            batches += 1
        elapsed, cpu = time.perf_counter() - start, [b - a for a, b in zip(cpu, cpu_seconds())]
        skipped, load = loader.skipped_samples, os.getloadavg()[0]  # load: others' processes share the cores
    finally:
        loader.close()
    seq_length, rows_s = settings.seq_length, totals["rows"] / elapsed
    row = {"case": name, "source": "loader", "packing": pack, "workers": workers, "skipped": skipped,
           "load_1min": load, "first_batch_s": first, "micro_batches": batches, "seconds": elapsed,
           "rows_s": rows_s, "samples_s": totals["samples"] / elapsed, "samples_per_row": totals["samples"] /
           totals["rows"], "cpu_s_per_row": sum(cpu) / totals["rows"], "main_cpu_s_per_row": cpu[0] / totals["rows"],
           "fill": totals["real_tokens"] / (totals["rows"] * seq_length), "row_tokens_s": rows_s * seq_length,
           **{f"{key}_s": totals[key] / elapsed for key in ("real_tokens", "loss_tokens", "patches")}}
    if recorded_tokens_s:
        row["ratio_vs_gpu"] = rows_s / (recorded_tokens_s / seq_length)
    return row


def measure_training(name: str, case, path: Path, workers: int, device: str, out: Path) -> dict:
    """The case's own `mimo run` (bench/throughput.py's arguments) on the dataset, packing on."""
    _, _, mbs, microbatches = case[:4]
    args = case_args(*case[:4], False, False, out, name, device)
    run = mimo_run(args + ["--data", str(path), "--num-workers", str(workers), "--pack-sequences"], out,
                   f"train_{name}")
    row = {"case": name, "source": f"mimo run, {device}", "packing": True, "workers": workers, "status": run.status,
           "command": run.printed()}
    if run.status == "ok" and run.records:  # a global batch is mbs x micro-batches rows, packed or not
        row["rows_s"] = mbs * microbatches / (steady(run.records)["elapsed_ms"] / 1000)
        row["row_tokens_s"] = row["rows_s"] * case_settings(case)[1].seq_length
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/data_loader"))
    parser.add_argument("--data", type=Path, help="the chat dataset's directory (written there when missing)")
    parser.add_argument("--num-samples", type=int, default=800, help="samples of the dataset written")
    parser.add_argument("--cases", nargs="*", default=["dense", "nemotron-mid"], choices=["dense", "nemotron-mid"])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="loader workers per lane")
    parser.add_argument("--seconds", type=float, default=30.0, help="steady state timed per measurement")
    parser.add_argument("--no-unpacked", action="store_true", help="skip the measurements without packing")
    parser.add_argument("--packing-buffer-size", type=int, default=64, help="as mimo run's (its default)")
    parser.add_argument("--train", action="store_true", help="also time each case's `mimo run` on the dataset, "
                        "with the most workers given (the bench config: a GPU; on a CPU only with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny cases, data and timings: checks the script only")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch

    cases, device = (QUICK_CASES, "cpu") if args.quick else (CASES, "cuda" if torch.cuda.is_available() else "cpu")
    recorded = {} if args.quick else RECORDED_TOKENS_PER_S  # the tiny cases are not the recorded ones
    if args.quick:
        args.num_samples, args.seconds = min(args.num_samples, 48), min(args.seconds, 1.0)
    results = Results("data_loader", [
        ("case", "case", ""), ("source", "source", ""), ("packing", "packing", ""), ("workers", "workers", "d"),
        ("samples_s", "samples/s", ".1f"), ("samples_per_row", "samples/row", ".2f"), ("fill", "row fill", ".0%"),
        ("rows_s", "rows/s", ".2f"), ("real_tokens_s", "real tokens/s", ".0f"),
        ("loss_tokens_s", "loss tokens/s", ".0f"), ("patches_s", "patches/s", ".0f"),
        ("cpu_s_per_row", "CPU s/row", ".3f"), ("main_cpu_s_per_row", "of it main", ".3f"),
        ("skipped", "skipped", "d"), ("load_1min", "load", ".1f"), ("ratio_vs_gpu", "x GPU training (docs)", ".2f"),
        ("ratio_vs_train", "x training here", ".2f"), ("status", "status", ""),
    ])
    with tempfile.TemporaryDirectory() as scratch:
        path = args.data or Path(scratch) / "chat"
        if not (path / ".nv-meta").exists():
            print(f"writing {args.num_samples} chat samples to {path}", flush=True)
            write_chat_dataset(path, args.num_samples, scale=0.1 if args.quick else 1.0)
        for name in args.cases:
            for pack in [True] if args.no_unpacked else [True, False]:
                for workers in args.workers:
                    print(f"== {name}: loader, packing {'on' if pack else 'off'}, {workers} workers", flush=True)
                    results.rows.append(measure_loader(name, cases[name], path, workers, pack, args.seconds,
                                                       args.packing_buffer_size, recorded.get(name)))
            if args.train:
                train = measure_training(name, cases[name], path, max(args.workers), device, args.out)
                for row in results.rows:
                    if row["case"] == name and row["source"] == "loader" and train.get("rows_s"):
                        row["ratio_vs_train"] = row["rows_s"] / train["rows_s"]
                results.rows.append(train)
    for name in args.cases:
        packed = [r for r in results.rows if r["case"] == name and r["source"] == "loader" and r["packing"]]
        if recorded.get(name) and packed:
            training = recorded[name] / case_settings(cases[name])[1].seq_length
            best = max(packed, key=lambda r: r["rows_s"])
            cores = 3 * training * max(r["cpu_s_per_row"] for r in packed)  # the costliest measurement
            results.notes.append(
                f"{name}: GPU training takes {recorded[name]} tokens/s = {training:.2f} rows/s (docs/benchmarks.md "
                f"(a)); packed, the loader gives {best['rows_s']:.2f} rows/s with {best['workers']} workers = "
                f"{best['rows_s'] / training:.2f}x: >= 3x {'holds' if best['rows_s'] >= 3 * training else 'fails'}"
                f" here; at up to {max(r['cpu_s_per_row'] for r in packed):.3f} CPU s per row, 3x takes "
                f"{cores:.1f} cores' worth of loader workers per lane")
    results.write(args.out, {"command": shlex.join(["python", *sys.argv]), "dataset": {
        "path": str(args.data) if args.data else "(temporary)", "num_samples": args.num_samples},
        "recorded_gpu_tokens_per_s": recorded})


if __name__ == "__main__":
    main()
