"""Hugging Face weights into this rank's part of the model, slice by slice, straight from the safetensors files.

Every rank runs the same code on its own modules: it walks the sharded state dict the Checkpointer saves
(`model.sharded_state_dict()`, factories applied, so that Mamba's in_proj parts and the stacked experts and
layers are views of the parameters), asks the provider's tensor map where each key's global tensor is, and reads
only the hyper-rectangle the rank holds into the parameter itself. Nothing is converted first, nothing is
gathered; a process holds its model shard plus one bounded read buffer (plugins/kit/safetensors_io.py).

Keys that no map has keep the model's seeded initialization (the projector, when the LLM and the encoder come as
parts), and are named in one line; a key under a map's `covers` that the map lacks is an error. Errors are
agreed over the world, so every rank stops with the same line and none waits in a collective.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from mimo.errors import UsageError
from mimo.plugins.kit.safetensors_io import FolderSource
from mimo.plugins.kit.tensor_map import TensorMap, read_into, shape_of

from ..adapters.apply import is_adapter_name

_WRAPPER = re.compile(r"^(language_model\.|modality_submodules\.[^.]+\.)(?:module\.)+")
EXTRA_STATE = "_extra_state"


def dist_key(key: str) -> str:
    """A saved key without the DDP wrapper's `module.` (the maps' keys)."""
    return _WRAPPER.sub(r"\1", key)


def rank_tensors(module, metadata: dict | None = None) -> list:
    """(dist key, ShardedTensor) of every tensor this rank's modules save, as the Checkpointer saves them, with
    factories applied: their `data` are views of the parameters and buffers. `metadata`: for a megatron module
    outside mimo's model wrapper, e.g. {"dp_cp_group": group}."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = module.sharded_state_dict() if metadata is None else module.sharded_state_dict(metadata=metadata)
    # a Hugging Face folder holds a base model: a LoRA run's adapters start from their own initialization
    state = {key: value for key, value in state.items() if not is_adapter_name(key)}
    apply_factories(state)
    return [(dist_key(t.key), t) for t in nested_values(state) if isinstance(t, ShardedTensor)]


def rank_index(sh) -> tuple:
    """The hyper-rectangle of the global tensor a ShardedTensor holds: the prepended axes (layers, experts) one
    position each, then its local extent."""
    pre = sh.prepend_axis_num
    return tuple((o, o + 1) for o in sh.global_offset[:pre]) + \
        tuple((o, o + n) for o, n in zip(sh.global_offset[pre:], sh.local_shape))


def load_into(module, sources: Iterable[tuple[TensorMap, object]],
              metadata: dict | None = None) -> tuple[list[str], list[str], list[str]]:
    """Fill this rank's tensors of `module` from `sources` ((map, reader) pairs). Returns (keys read, keys left at
    initialization, error lines); never raises for a mismatch, so that the caller can agree errors first."""
    sources = list(sources)
    held = {p.untyped_storage().data_ptr() for p in list(module.parameters()) + list(module.buffers())}
    read, initial, errors = [], [], []
    with torch.no_grad():
        for key, sh in rank_tensors(module, metadata):
            if key.endswith(EXTRA_STATE):
                continue
            owner = next(((tmap, reader) for tmap, reader in sources if key in tmap.tensors), None)
            if owner is None:
                if any(tmap.covered(key) for tmap, _ in sources):
                    errors.append(f"the Hugging Face checkpoint has no tensor for {key}")
                else:
                    initial.append(key)
                continue
            tmap, reader = owner
            spec = tmap.tensors[key]
            try:
                shape = shape_of(spec, reader.shape)
            except UsageError as err:
                errors.append(f"{key}: {err}")
                continue
            if shape != tuple(sh.global_shape):
                errors.append(f"{key} has shape {list(sh.global_shape)} in the model, {list(shape)} from "
                              f"{_names(spec)} in {getattr(reader, 'folder', 'the checkpoint')}")
                continue
            if sh.data.untyped_storage().data_ptr() not in held:  # a factory that copies would load nothing
                errors.append(f"{key}: its saved form is not a view of a parameter; mimo cannot load it in place")
                continue
            out = sh.data.view((1,) * sh.prepend_axis_num + tuple(sh.data.shape))
            read_into(spec, rank_index(sh), out, reader)
            read.append(key)
    return read, initial, errors


def hf_loader(plan, model):
    """The Checkpointer's `load_hf` for this plan's Hugging Face folders, or None when it has none."""
    from .hf import hf_sources, hf_sources_of

    if not hf_sources(plan.config.checkpoint):
        return None
    return lambda: load_hf(model, hf_sources_of(plan))


def _names(spec) -> str:
    from mimo.plugins.kit.tensor_map import leaves

    names = sorted({leaf.name for leaf in leaves(spec)})
    return names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"


def load_hf(model, sources: list[tuple[str, object, TensorMap]]) -> None:
    """Every rank: load its slices from `sources` ((what, folder, map): what names the source for the user,
    e.g. "--pretrained-llm DIR"), agree on errors, and say on the first rank what was loaded. Collective."""
    started = time.perf_counter()
    readers = [(what, FolderSource(folder), tmap) for what, folder, tmap in sources]
    try:
        read, initial, errors = load_into(model, [(tmap, reader) for _, reader, tmap in readers])
        nbytes = sum(reader.meter.bytes for _, reader, _ in readers)
    finally:
        for _, reader, _ in readers:
            reader.close()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (errors, sorted(set(initial)), nbytes))
    errors = [e for rank_errors, _, _ in everyone for e in rank_errors]
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise UsageError(f"{', '.join(w for w, _, _ in sources)}: {errors[0]}{more}")
    if dist.get_rank() == 0:
        total = sum(b for _, _, b in everyone)
        print(f"loaded weights from {', '.join(w for w, _, _ in sources)} (Hugging Face; each rank read its slices: "
              f"{total / 2**20:.1f} MiB in all) in {time.perf_counter() - started:.2f} s", flush=True)
        fresh = sorted({k for _, keys, _ in everyone for k in keys})
        if fresh:
            print(f"starts from initialization: {_grouped(fresh)}", flush=True)


_MODULE = re.compile(r"^(language_model\.|modality_submodules\.[^.]+\.(?:encoders|input_projections)\.[^.]+\.)")


def _grouped(keys: list[str]) -> str:
    """Keys by the module they belong to (the LLM, an encoder, a projection), with counts."""
    groups: dict[str, int] = {}
    for key in keys:
        match = _MODULE.match(key)
        head = match.group(1) if match else key.rsplit(".", 1)[0] + "."
        groups[head] = groups.get(head, 0) + 1
    return ", ".join(f"{head}* ({n} tensor{'s' * (n != 1)})" for head, n in groups.items())


def global_tensors(module, metadata: dict | None = None) -> dict[str, torch.Tensor]:
    """{dist key: whole tensor} of a module held whole by this process (a world of one): for converting a model
    in memory (tests, the contract kit)."""
    out: dict[str, torch.Tensor] = {}
    for key, sh in rank_tensors(module, metadata):
        if key.endswith(EXTRA_STATE):
            continue
        whole = out.setdefault(key, torch.empty(tuple(sh.global_shape), dtype=sh.data.dtype))
        target = whole[tuple(slice(a, b) for a, b in rank_index(sh))]
        target.copy_(sh.data.detach().reshape(target.shape))
    return out
