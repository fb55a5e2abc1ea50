"""A real-shaped dataset for training benchmarks: LLaVA-style records with photo-sized images (small crops to 1080p
frames, phone screenshots and panoramas), one to five rounds with long-tailed answers, some records without an
image and some with two (bench/real_shaped_records.py says what and how many), converted by `mimo data convert
llava` into an energon dataset.

    python bench/real_shaped_data.py --out results/real_data            # 2000 records, then converted
    python bench/real_shaped_data.py --out $OUT/real --workers 8        # a GPU host: 8 processes draw the images
    mimo run --provider nemotron-moe-vlm-mid --data results/real_data/dataset ...
    python bench/real_shaped_data.py --out /tmp/real --records 24 --provider nemotron-moe-vlm-tiny  # a CPU run's

Written under --out: `llava.json` and `images/<size class>/` (the source), `dataset/` (the energon dataset:
`mimo.data.convert.convert_llava`, which `mimo data convert llava` runs) and `real_shaped_data.json`: the mix
(shares, images per size class with their bytes, words per turn), tokens per sample as --provider reads them (its
tokenizer, chat template and image mode; what its seq_length cuts), the sizes and the seconds each step took (wall
and CPU). A folder already holding this dataset for the same --records and --seed is kept.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path

from common import Results
from real_shaped_records import IMAGES_PER_RECORD, ROUNDS, SIZE_CLASSES, write_source


# -- the summary ---------------------------------------------------------------------------------------------------

def percentiles(values, points=(10, 50, 90, 99)) -> dict:
    ordered = sorted(values)
    if not ordered:
        return {}
    figures = {f"p{p}": ordered[min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1)] for p in points}
    return {**figures, "max": ordered[-1], "mean": round(statistics.fmean(ordered), 1)}


def mix_figures(plans) -> dict:
    """Shares of text-only, one- and two-image records, of size classes, of rounds; words per turn."""
    records = len(plans)
    images = [spec for _, specs in plans for spec in specs]
    by_count = {n: sum(len(specs) == n for _, specs in plans) / records for n, _ in IMAGES_PER_RECORD}
    turns = [turn for record, _ in plans for turn in record["conversations"]]
    words = {side: [len(t["value"].replace("<image>", " ").split()) for t in turns if t["from"] == side]
             for side in ("human", "gpt")}
    return {"records": records, "images": len(images), "text_only_share": by_count[0],
            "one_image_share": by_count[1], "two_image_share": by_count[2],
            "class_shares": {kind: sum(s.kind == kind for s in images) / max(1, len(images))
                             for kind, _ in SIZE_CLASSES},
            "png_share": sum(s.format == "PNG" for s in images) / max(1, len(images)),
            "rounds": {n: sum(len(r["conversations"]) == 2 * n for r, _ in plans) / records for n, _ in ROUNDS},
            "question_words": percentiles(words["human"]), "answer_words": percentiles(words["gpt"])}


def class_rows(plans, image_dir: Path) -> list[dict]:
    rows = []
    images = [spec for _, specs in plans for spec in specs]
    for kind, _ in SIZE_CLASSES:
        specs = [s for s in images if s.kind == kind]
        sizes = [(image_dir / s.name).stat().st_size for s in specs]
        rows.append({"class": kind, "images": len(specs), "share": len(specs) / max(1, len(images)),
                     "png": sum(s.format == "PNG" for s in specs),
                     "megapixels": statistics.fmean(s.width * s.height / 1e6 for s in specs) if specs else None,
                     "kb_median": statistics.median(sizes) / 1024 if sizes else None,
                     "mb": sum(sizes) / 2**20})
    return rows


def provider_reading(provider: str, assignments: list[str]):
    """(settings, prompt format) of `provider` with `assignments`, as `mimo run --set` builds them."""
    from mimo.errors import UsageError
    from mimo.plugins import Registry
    from mimo.plugins.settings import build_settings

    registry = Registry()
    settings = build_settings(registry.get(provider)[0], assignments)
    fmt = registry.hooks(provider).prompt_format(settings=settings)
    if fmt is None:
        raise UsageError(f"provider '{provider}' has no prompt_format hook: its tokens cannot be counted")
    return settings, fmt


def token_figures(plans, settings, fmt) -> dict:
    """Tokens per sample as the provider's task encoder renders them (its tokenizer, chat template and image mode:
    image tokens from each image's size) and what its seq_length cuts, as `ConversationTaskEncoder.encode_sample`
    counts them; no pixels are read."""
    from mimo.data.conversation import place_images, turns_from_chat_json

    seq, totals, images, cut_answers, answers = settings.seq_length, [], [], 0, 0
    for record, specs in plans:
        turns = place_images(turns_from_chat_json(record), len(specs))
        counts = [fmt.image_mode.num_tokens(s.height, s.width) for s in specs]
        rendered = fmt.template.render(turns, counts, fmt.tokenizer)
        cut = min(seq, len(rendered.tokens))
        for start, length in rendered.image_runs:  # as the task encoder cuts: never half an image
            if start + length > cut:
                cut = start
                break
        totals.append(len(rendered.tokens))
        images.append(sum(counts))
        answers += sum(rendered.trained)
        cut_answers += sum(rendered.trained[cut:])
    return {"tokenizer": type(fmt.tokenizer).__name__,
            "seq_length": seq, "tokens_per_sample": percentiles(totals), "image_tokens_per_sample":
            percentiles(images), "longer_than_seq_length": sum(t > seq for t in totals) / len(totals),
            "answer_tokens_cut_share": cut_answers / max(1, answers)}


# -- the command ---------------------------------------------------------------------------------------------------

def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def convert(source: Path, dataset: Path, shard_size: int, val_fraction: float):
    """What `mimo data convert llava SOURCE/llava.json SOURCE/images DATASET` runs; energon's prints hidden."""
    from mimo.data.convert import convert_llava

    console = sys.stdout
    with contextlib.redirect_stdout(io.StringIO()):
        return convert_llava(source / "llava.json", source / "images", dataset, val_fraction=val_fraction,
                             shard_size=shard_size, say=lambda line: print(line, file=console, flush=True))


def kept(out: Path, records: int, seed: int) -> bool:
    """The folder holds this dataset already (a summary of the same --records and --seed, a prepared dataset)."""
    try:
        summary = json.loads((out / "real_shaped_data.json").read_text())
    except (OSError, ValueError):
        return False
    return (summary.get("records"), summary.get("seed")) == (records, seed) and \
        (out / "dataset" / ".nv-meta" / "dataset.yaml").is_file()


def cpu_seconds() -> float:
    """CPU seconds of this process and its ended children (the image writers) so far."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/real_data"), help="a new folder (or one holding "
                        "this dataset already, which is kept)")
    parser.add_argument("--records", type=int, default=2000, help="LLaVA records to write")
    parser.add_argument("--seed", type=int, default=0, help="the same seed writes the same records and images")
    parser.add_argument("--workers", type=int, default=1, help="processes drawing the images (the same files)")
    parser.add_argument("--shard-size", type=int, default=200, help="records per tar shard (convert's option)")
    parser.add_argument("--val-fraction", type=float, default=0.0, help="convert's option: a val split")
    parser.add_argument("--provider", default="nemotron-moe-vlm-mid", help="whose tokens per sample to count")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                        help="the provider's settings for the count, as mimo run's --set")
    parser.add_argument("--no-convert", action="store_true", help="write the LLaVA source only")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # the libraries' import-time notes (no CUDA, no transformer-engine)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from mimo.errors import UsageError

    if args.records < 1 or args.workers < 1:
        parser.error("--records and --workers must be 1 or more")
    try:
        settings, fmt = provider_reading(args.provider, args.assignments)
    except UsageError as err:
        parser.error(str(err))
    dataset = args.out / "dataset"
    train = f"mimo run --provider {args.provider} --data {dataset}"
    if kept(args.out, args.records, args.seed):
        print(f"{dataset}: kept (written earlier with the same --records and --seed)\n{train}")
        return
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty (and holds no dataset of --records {args.records} --seed "
                     f"{args.seed}): choose a new folder")
    start, cpu = time.perf_counter(), cpu_seconds()
    plans = write_source(args.out, args.records, args.seed, args.workers)
    written, written_cpu = time.perf_counter() - start, cpu_seconds() - cpu
    mix = mix_figures(plans)
    source_mb = folder_mb(args.out / "images") + (args.out / "llava.json").stat().st_size / 2**20
    summary = {"command": shlex.join(["python", *sys.argv]), "records": args.records, "seed": args.seed,
               "workers": args.workers, "load_1min": os.getloadavg()[0], "write_s": written,
               "write_cpu_s": written_cpu, "source_mb": source_mb, "mix": mix}
    results = Results("real_shaped_data", [
        ("class", "size class", ""), ("images", "images", "d"), ("share", "share", ".0%"), ("png", "PNG", "d"),
        ("megapixels", "mean MP", ".2f"), ("kb_median", "median KB", ".0f"), ("mb", "MB", ".1f")],
        rows=class_rows(plans, args.out / "images"))
    aw = mix["answer_words"]
    results.notes += [
        f"{args.records} records (seed {args.seed}): {mix['text_only_share']:.0%} text-only, "
        f"{mix['one_image_share']:.0%} one image, {mix['two_image_share']:.0%} two; {mix['images']} images, "
        f"{source_mb:.0f} MB, written in {written:.1f} s ({written_cpu:.1f} s CPU)",
        f"answer words p10 {aw['p10']} p50 {aw['p50']} p90 {aw['p90']} p99 {aw['p99']} max {aw['max']}; "
        f"question words p50 {mix['question_words']['p50']}"]
    if not args.no_convert:
        import mimo.data.convert  # noqa: F401 - imported (torch, energon: seconds) before the clock starts
        start, cpu = time.perf_counter(), cpu_seconds()
        result = convert(args.out, dataset, args.shard_size, args.val_fraction)
        seconds, seconds_cpu = time.perf_counter() - start, cpu_seconds() - cpu
        summary.update(convert_s=seconds, convert_cpu_s=seconds_cpu, convert_records_per_s=args.records / seconds,
                       convert_records_per_cpu_s=args.records / seconds_cpu, dataset_mb=folder_mb(dataset),
                       train=result.train, val=result.val, skipped=len(result.bad), convert_command=shlex.join(
                           ["mimo", "data", "convert", "llava", str(args.out / "llava.json"),
                            str(args.out / "images"), str(dataset), "--shard-size", str(args.shard_size),
                            "--val-fraction", str(args.val_fraction)]))
        results.notes.append(f"{result.summary()} in {seconds:.1f} s ({seconds_cpu:.1f} s CPU: "
                             f"{summary['convert_records_per_cpu_s']:.0f} records per CPU second), "
                             f"{summary['dataset_mb']:.0f} MB")
    summary["tokens"] = tokens = {"provider": args.provider, "settings": args.assignments,
                                  **token_figures(plans, settings, fmt)}
    t = tokens["tokens_per_sample"]
    results.notes.append(
        f"tokens per sample ({args.provider}, {tokens['tokenizer']}): p10 {t['p10']} p50 {t['p50']} p90 "
        f"{t['p90']} p99 {t['p99']} max {t['max']}, of them image tokens p50 "
        f"{tokens['image_tokens_per_sample']['p50']}; seq_length {tokens['seq_length']} cuts "
        f"{tokens['longer_than_seq_length']:.0%} of the samples, {tokens['answer_tokens_cut_share']:.0%} of the "
        f"answer tokens")
    if not args.no_convert:
        results.notes.append(f"train on it: {train}")
    results.write(args.out, summary)


if __name__ == "__main__":
    main()
