"""What `mimo ckpt inspect` says about a LoRA checkpoint (adapters alone): their options and targets, their
parameters per module apart from the base's, and the base they were trained on, with its size and whether it is
still there and unchanged. From the checkpoint's files alone."""

from __future__ import annotations

from pathlib import Path


def adapters_summary(directory: Path, common: dict) -> dict:
    """The adapters of the checkpoint in `directory` (its common.pt: `common`), as `inspect --json` prints them."""
    from mimo.core.checkpoint import adapter_state
    from mimo.core.config.adapters import parse_targets

    run, record = common["run"], common.get("adapters") or {}
    options = (run.get("options") or {}).get("adapters") or {}
    kept = run.get("adapters") or {}  # the run's record of its built adapters (older checkpoints: none)
    counts = kept.get("parameters") or _counted(directory)
    targets = kept.get("targets") or (parse_targets(options["lora_targets"]) if options.get("lora_targets") else None)
    rank = options.get("lora_rank") or 0
    base_counts = list((run.get("parameters") or {}).values())
    base = sum(base_counts) if base_counts and all(base_counts) else None
    trainable = sum(counts.values())
    return {
        "rank": rank, "alpha": options.get("lora_alpha") or 2 * rank, "experts": options.get("lora_experts"),
        "dropout": options.get("lora_dropout"), "targets": targets, "parameters": counts, "trainable": trainable,
        "share": trainable / (base + trainable) if base else None, "base": record,
        "base_status": adapter_state.base_status(record), "base_size_bytes": _base_size(record),
    }


def adapter_lines(adapters: dict) -> list[str]:
    """The lines after the table: the adapters, then their base."""
    from mimo.core.checkpoint.adapter_state import describe
    from mimo.core.run.lora_report import targets_text

    targets = targets_text(adapters["targets"]) if adapters["targets"] else "the provider's default targets"
    dropout = f", dropout {adapters['dropout']:g}" if adapters["dropout"] else ""
    share = (f" ({100 * adapters['share']:.1f}% of the adapted model's parameters)"
             if adapters["share"] is not None else "")
    size = adapters["base_size_bytes"]
    return [f"LoRA adapters: rank {adapters['rank']}, alpha {adapters['alpha']:g}, experts {adapters['experts']}"
            f"{dropout} on {targets}; {adapters['trainable']:,} trainable parameters{share}",
            f"base: {describe(adapters['base'])}" + (f", {size / 2**20:.1f} MiB" if size else "") +
            f"; {adapters['base_status']}"]


def _counted(directory: Path) -> dict[str, int]:
    """{module: adapter parameters} from the checkpoint's metadata (the model's tensors, not their optimizer
    state), for checkpoints that do not record them."""
    import math

    from mimo.core.adapters.apply import is_adapter_name
    from mimo.core.run.lora_report import module_of
    from mimo.plugins.kit.dist_checkpoint import saved_tensor_shapes

    counts: dict[str, int] = {}
    for key, (shape, _) in saved_tensor_shapes(directory).items():
        if key.startswith(("language_model.", "modality_submodules.")) and is_adapter_name(key):
            counts[module_of(key)] = counts.get(module_of(key), 0) + math.prod(shape)
    return counts


def _base_size(record: dict) -> int | None:
    """Bytes of the base's weights where they still are (a save directory: its tracked checkpoint's)."""
    from mimo.core.checkpoint.layout import iteration_dir, read_tracker

    total = 0
    for was in record.get("folders", {}).values():
        path = Path(was["path"])
        if not path.exists():
            return None
        iteration = read_tracker(path) if path.is_dir() else None
        folder = iteration_dir(path, iteration) if iteration is not None else path
        total += sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() \
            else folder.stat().st_size
    return total or None
