"""`mimo ckpt export-hf`: a mimo checkpoint (saved in any layout) as a Hugging Face model folder, streamed.

No model is built and no process group started. The provider's `hf_export` gives config.json, the tensor map of
the whole model and the other files (tokenizer, processor); the map is inverted into components (Hugging Face
tensors and the saved keys they share: one attention layer's q, k, v and its fused key, one MoE layer's experts
and their stacked key). Each component's keys are read whole from the checkpoint with torch's DCP reader (only
those keys, from whatever layout saved them), converted, and written into shards whose headers were planned from
the shapes alone. The process holds one component at a time: at most one MoE layer's stacked experts.

Refused, each with one line, before anything is read: settings the Hugging Face model cannot express (all of them,
with the `--set` values to train with), a `--set` that would change the model, an output folder that is not
empty or is the checkpoint's own directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mimo.errors import UsageError
from mimo.plugins import Registry
from mimo.plugins.kit.safetensors_io import CONFIG_FILE, DEFAULT_SHARD_BYTES, ShardWriter, readable_by_all, write_json
from mimo.plugins.kit.tensor_map import components, contributions, hf_shapes, hf_tensor
from mimo.plugins.settings import build_settings

from . import atomic_dir, checksums
from .hf import plain_value
from .hf_load import dist_key
from .layout import TRACKER, iteration_dir, read_common, read_tracker


def export_hf(checkpoint: Path, out: Path, assignments: list[str] = (), max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              registry: Registry | None = None) -> tuple[str, list[str]]:
    """Write the checkpoint's weights as a Hugging Face folder `out`. Returns (provider, notes for the user)."""
    checkpoint, out = Path(checkpoint), Path(out)
    directory, common, export = open_export(checkpoint, out, assignments, registry)
    run = common["run"]
    if common["contents"].get("adapters"):
        raise UsageError(f"{directory} holds LoRA adapters only: export them as a PEFT adapter with --adapter-only, "
                         f"or the whole model after mimo ckpt merge-lora {checkpoint} MERGED")
    checksums.verify(directory)
    saved = saved_tensors(directory)
    tmap = export.tensors
    needed = set(tmap.tensors) | {k for keys, _ in tmap.derived.values() for k in keys}
    if missing := sorted(needed - set(saved)):
        raise UsageError(f"{directory} lacks {len(missing)} tensors the export needs, e.g. {missing[0]}")
    shapes = hf_shapes(tmap, lambda key: tuple(saved[key][1].size))
    contrib = contributions(tmap, shapes.__getitem__)
    dtypes = {name: saved[pieces[0][0]][1].properties.dtype for name, pieces in contrib.items()}
    reader = Reader(directory, saved)
    derived = {name: fn(*(reader.load([k])[k] for k in keys)) for name, (keys, fn) in tmap.derived.items()}
    groups = components(contrib)
    plan = [(n, dtypes[n], shapes[n]) for group in groups for n in group]
    plan += [(n, t.dtype, tuple(t.shape)) for n, t in derived.items()]

    # written into a partial folder renamed to OUT at the end: a killed export leaves no OUT, and its partial
    # folder is removed by the next export into OUT
    with atomic_dir.writing(out, what="export") as scratch:
        writer = ShardWriter(scratch, plan, max_shard_bytes)  # writes in the plan's order
        for group in groups:  # one component in memory at a time
            tensors = reader.load(sorted({key for name in group for key, *_ in contrib[name]}))
            for name in group:
                writer.write(name, hf_tensor(contrib[name], tensors, shapes[name], dtypes[name]))
            del tensors
        for name, tensor in derived.items():
            writer.write(name, tensor)
        writer.finish()
        floats = {dtype for _, dtype, _ in plan if dtype.is_floating_point}
        config = {**export.config, "dtype": "bfloat16" if floats == {torch.bfloat16} else "float32"}
        write_json(scratch / CONFIG_FILE, config)
        for name, content in export.files.items():
            (scratch / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        readable_by_all(scratch)
    return run["provider"], list(export.notes)


def open_export(checkpoint: Path, out: Path, assignments, registry: Registry | None):
    """(iteration directory, common.pt, the provider's HFExport) of a checkpoint to export into `out`; every
    refusal that needs no tensor read, one line each."""
    registry = registry or Registry()
    iteration = read_tracker(checkpoint)
    if iteration is None:
        raise UsageError(f"no checkpoint in {checkpoint} ({TRACKER} is missing; give the save directory)")
    directory = iteration_dir(checkpoint, iteration)
    check_output(out, checkpoint)
    common = read_common(directory)
    run = common["run"]
    provider, _ = registry.get(run["provider"])
    hooks = registry.hooks(run["provider"])
    settings = export_settings(provider, hooks, run["settings"], list(assignments))
    refused = hooks.hf_export_check(settings=settings)
    if refused is None:
        raise UsageError(f"provider '{run['provider']}' exports no Hugging Face models (no hf_export hook)")
    if refused:
        raise UsageError(f"{directory} cannot be exported to Hugging Face: {not_exportable(refused)}")
    return directory, common, hooks.hf_export(settings=settings)


def saved_tensors(directory: Path) -> dict:
    """dist key -> (saved key, its DCP metadata) of every tensor the checkpoint holds."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(directory)).read_metadata()
    return {dist_key(k): (k, m) for k, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}


class Reader:
    """Whole global tensors of chosen keys, read with torch's DCP reader in this process alone."""

    def __init__(self, directory: Path, saved: dict):
        self.directory, self.saved = directory, saved

    def load(self, keys: list[str]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        state = {self.saved[k][0]: torch.empty(tuple(self.saved[k][1].size), dtype=self.saved[k][1].properties.dtype)
                 for k in keys}
        try:
            dcp.load(state, storage_reader=FileSystemReader(str(self.directory)), no_dist=True)
        except BaseException as err:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            first = (str(err).strip().splitlines() or [""])[0]
            raise UsageError(f"checkpoint {self.directory} cannot be read ({type(err).__name__}: "
                             f"{first[:300]})") from None
        return {k: state[self.saved[k][0]] for k in keys}


def check_output(out: Path, checkpoint: Path) -> None:
    """OUT is new or empty, and not the checkpoint's directory (nor inside it, nor another save directory): a
    Hugging Face folder there would make `--pretrained CKPT` read it as one."""
    resolved, root = out.resolve(), checkpoint.resolve()
    if resolved == root or root in resolved.parents or (out / TRACKER).exists() or any(out.glob("iter_*")):
        raise UsageError(f"{out} is the checkpoint's own directory (or a save directory): export into another "
                         f"folder (a Hugging Face folder there would make --pretrained {checkpoint} read it as one)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        held = sorted(p.name for p in out.iterdir())[:3] if out.is_dir() else []
        raise UsageError(f"{out} is not empty{f' (it holds {held})' if held else ''}: export into a new folder")


def export_settings(provider, hooks, saved: dict, assignments: list[str]):
    """The checkpoint's settings with `--set` applied; a `--set` that changes the model is one line."""
    settings = build_settings(provider, [], run_file_values=saved, run_file=Path("common.pt"))
    if not assignments:
        return settings
    changed = build_settings(provider, assignments, run_file_values=saved, run_file=Path("common.pt"))
    if hooks.model_shape(settings=changed) != hooks.model_shape(settings=settings):
        differ = [f"{k} {plain_value(getattr(settings, k))!r} there" for k in vars(settings)
                  if plain_value(getattr(settings, k)) != plain_value(getattr(changed, k))]
        flags = " ".join(f"--set {a}" for a in assignments)
        raise UsageError(f"export-hf {flags} changes the model this checkpoint holds ({', '.join(differ)}): --set "
                         f"at export only chooses what goes beside the weights (e.g. tokenizer_path=DIR)")
    return changed


def export_note(hooks, settings) -> str | None:
    """The start-of-run line for settings whose checkpoints cannot be exported (None: they can, or the provider
    exports nothing)."""
    refused = hooks.hf_export_check(settings=settings)
    if not refused:
        return None
    return f"note: checkpoints of these settings cannot be exported to Hugging Face: {not_exportable(refused)}"


def not_exportable(refused: dict) -> str:
    """`projection='affine', ...; to train an exportable model add --set projection=mlp ...`."""
    have = ", ".join(f"{name}={value[0]!r}" for name, value in refused.items())
    flags = " ".join(f"--set {name}={_text(value[1])}" for name, value in refused.items())
    return f"{have}; to train an exportable model add {flags}"


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
