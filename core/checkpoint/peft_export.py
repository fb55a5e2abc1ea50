"""`mimo ckpt export-hf CK OUT --adapter-only`: a LoRA run's adapter checkpoint as a PEFT LoRA adapter folder
(adapter_config.json, adapter_model.safetensors) that `peft.PeftModel.from_pretrained(base, OUT)` loads onto the
Hugging Face model of the base the adapters were trained on (its `export-hf`, or the folder it was imported from).

No model is built and no process group started. Each adapter's A and B are read whole (gathered from the TP shards
that saved them) and put where the provider's export puts the base weight: the tensor map says which rows of which
Hugging Face tensor the weight's rows become (a fused linear_qkv's q, k and v; Mamba's in_proj parts; one item per
stacked layer or expert), the export's `loaded_modules` which modules of the model transformers loads hold those
rows (named after transformers' load-time renaming: PEFT's target_modules match the loaded model). B is split as
the weight's rows are; A is the input side, the same for every part of a fused linear: each part's module gets the
whole A and its rows of B, so that its B A is exactly its rows of the fused B A.

Routed experts that transformers loads as 3-D parameters (the export's loaded module names the parameter and the
expert's row) go into PEFT's `target_parameters` (peft_experts.py): per-expert adapters exactly, shared ones
repeated for every expert.

Refused, one line each: a checkpoint of a whole model; a provider whose export names no loaded modules; routed
experts' adapters of the shared-outer layout (one A or B shared by a layer's experts, the other half per expert:
PEFT's expert layout has one A and one B per expert); an adapter whose weight lands in no module PEFT adapts, or on
a module another adapter lands on; a 3-D parameter adapted for some of its experts only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from mimo.errors import UsageError
from mimo.plugins import Registry
from mimo.plugins.kit.safetensors_io import SINGLE_FILE, ShardWriter, is_hf_folder, readable_by_all, write_json
from mimo.plugins.kit.tensor_map import Stack, TensorMap, contributions, hf_shapes

from ..config import AdapterOptions
from . import adapter_state, atomic_dir, checksums
from .hf_export import Reader, open_export, saved_tensors
from .peft_experts import expert_tensors

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# a linear's own adapter (`...linear_qkv.lora.a`; B saved part by part where the weight is: `.lora.b.part0`), and
# the one a MoE layer's routed experts share (`...mlp.experts.lora_linear_fc1.a`, core/adapters/experts.py)
_OWN = re.compile(r"^(?P<layer>.+)\.lora\.(?P<matrix>[ab])(?:\.part(?P<part>\d+))?$")
_SHARED = re.compile(r"^(?P<layer>.+)\.lora_(?P<linear>[A-Za-z0-9_]+)\.(?P<matrix>[ab])(?:\.part(?P<part>\d+))?$")
_OUTER = ".lora_outer_"  # a shared-outer layout's shared half (`...mlp.experts.lora_outer_linear_fc1.a`)


@dataclass
class Adapter:
    """One adapter in the checkpoint: the layer it adapts (for messages), the base weight's key it adapts (its
    `.weight` key, or the prefix of the parts the weight is saved in), and the keys of A and of B's parts."""

    layer: str
    weight: str
    a: str = ""
    b: dict = field(default_factory=dict)  # part number (0 when B is whole) -> key


def export_peft(checkpoint: Path, out: Path, assignments: list[str] = (),
                registry: Registry | None = None) -> tuple[str, list[str]]:
    """Write the adapters of the LoRA checkpoint in `checkpoint` as a PEFT adapter folder `out`. Returns (provider,
    notes for the user)."""
    checkpoint, out = Path(checkpoint), Path(out)
    directory, common, export = open_export(checkpoint, out, assignments, registry)
    run = common["run"]
    merge = f"mimo ckpt merge-lora {checkpoint} MERGED, then mimo ckpt export-hf MERGED {out}"
    if not common["contents"].get("adapters"):
        raise UsageError(f"--adapter-only: {directory} holds a whole model, no LoRA adapters (a run with --lora-rank "
                         f"saves those): export it without --adapter-only")
    if export.loaded_modules is None:
        raise UsageError(f"--adapter-only: provider '{run['provider']}' names no modules of its Hugging Face model "
                         f"for PEFT adapters (HFExport.loaded_modules); export the merged model instead: {merge}")
    checksums.verify(directory)
    saved = saved_tensors(directory)
    tmap = export.tensors
    roots = tuple(f"{key.split('.')[0]}." for key in tmap.tensors)  # the model's keys, not the optimizer's
    refuse_shared_outer(saved, merge)
    adapters = find_adapters([key for key in saved if key.startswith(roots)], tmap)
    if not adapters:
        raise UsageError(f"--adapter-only: {directory} holds no adapter tensors")
    tensors = Reader(directory, saved).load(sorted({k for a in adapters for k in (a.a, *a.b.values())}))

    placed: dict = {}  # module path, or an expert's row of a 3-D parameter (a LoadedModule) -> (A, B)
    owner: dict = {}
    for adapter in adapters:
        b_parts = [tensors[adapter.b[i]] for i in sorted(adapter.b)]
        for target, pair in place(adapter, tmap, export.loaded_modules, tensors[adapter.a], b_parts, merge).items():
            if target in owner:
                where = target if isinstance(target, str) else f"{target.path}.{target.parameter}[{target.expert}]"
                raise UsageError(f"--adapter-only: the adapters on {owner[target]} and {adapter.layer} both land on "
                                 f"the Hugging Face module {where}, which holds one PEFT adapter; export the merged "
                                 f"model instead: {merge}")
            placed[target], owner[target] = pair, adapter.layer
    modules = {t: pair for t, pair in placed.items() if isinstance(t, str)}
    parameters, weights = expert_tensors({t: pair for t, pair in placed.items() if not isinstance(t, str)})

    options = AdapterOptions(**run["options"]["adapters"])
    base, unverified = _hf_base(common.get("adapters") or {})
    config = {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": base, "inference_mode": True,
              "r": options.lora_rank, "lora_alpha": options.scale * options.lora_rank,
              # PEFT runs no dropout on adapted parameters (experts) and refuses any: inference is the same
              "lora_dropout": 0.0 if parameters else options.lora_dropout, "target_modules": sorted(modules),
              "target_parameters": parameters or None, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "init_lora_weights": True, "modules_to_save": None}
    for path in sorted(modules):
        a, b = modules[path]
        weights[f"base_model.model.{path}.lora_A.weight"] = a.contiguous()
        weights[f"base_model.model.{path}.lora_B.weight"] = b.contiguous()
    with atomic_dir.writing(out, what="export") as scratch:
        writer = ShardWriter(scratch, [(n, t.dtype, tuple(t.shape)) for n, t in weights.items()], 2**62)
        for name in writer.order:
            writer.write(name, weights[name])
        writer.finish()
        (scratch / SINGLE_FILE).rename(scratch / ADAPTER_WEIGHTS)
        write_json(scratch / ADAPTER_CONFIG, config)
        readable_by_all(scratch)
    notes = _derived_notes(tmap, adapters, export.loaded_modules) + ([unverified] if unverified else [])
    onto = base or "the Hugging Face export of the adapters' base (mimo ckpt export-hf BASE)"
    if parameters and options.lora_dropout:
        notes.append(f"lora_dropout is 0 in the adapter config (the run's {options.lora_dropout}): PEFT takes no "
                     f"dropout where it adapts parameters (the experts)")
    experts = f" and {len(parameters)} expert parameters" if parameters else ""
    notes.append(f"{len(adapters)} adapters on {len(modules)} Hugging Face modules{experts}: load them with "
                 f"peft.PeftModel.from_pretrained(model, '{out}') on {onto}")
    return run["provider"], notes


def _hf_base(record: dict) -> tuple[str | None, str | None]:
    """(the Hugging Face folder the adapters were trained on, for the adapter config's base_model_name_or_path,
    when it is still there with the same weights; else None, and the note saying why it is left out)."""
    was = record.get("folders", {}).get("pretrained")
    path = Path(was["path"]) if was else None
    if path is None or (path.exists() and not is_hf_folder(path)):
        return None, None  # a mimo checkpoint's adapters: their base is that checkpoint's export
    change = adapter_state.changed(path, was)
    if change is not None:
        return None, f"base_model_name_or_path left empty: the folder the adapters were trained on, {path}, {change}"
    return str(path), None


def shared_outer_note(options: AdapterOptions, targets: dict | None, expert_modules) -> str | None:
    """The start-up line of a run whose checkpoints cannot be exported as PEFT adapters (shared-outer adapters on
    routed experts: `expert_modules` are the modules with experts), told before it trains, not at export time."""
    if options.lora_experts != "shared-outer":
        return None
    if not any({"experts", "all"} & set((targets or {}).get(m, ())) for m in expert_modules):
        return None
    return ("note: --lora-experts shared-outer: the routed experts' adapters have no PEFT form, so this run's "
            "checkpoints export merged (mimo ckpt merge-lora, then mimo ckpt export-hf), not with --adapter-only; "
            "--lora-experts shared or per-expert export as PEFT adapters")


def refuse_shared_outer(keys, merge: str) -> None:
    """UsageError where the checkpoint's `keys` hold shared-outer expert adapters, which PEFT cannot represent."""
    outer = next((key for key in sorted(keys) if _OUTER in key), None)
    if outer is not None:
        raise UsageError(f"--adapter-only: the routed experts' adapters are --lora-experts shared-outer ({outer}: one "
                         f"half shared by a layer's experts), which PEFT's per-expert A and B cannot represent; "
                         f"export the merged model instead ({merge}) or train with --lora-experts shared or "
                         f"per-expert")


def find_adapters(keys, tmap: TensorMap) -> list[Adapter]:
    """The adapters among the checkpoint's `keys`, each with the key of the base weight the tensor map places."""
    found: dict[str, Adapter] = {}
    for key in sorted(keys):
        match = _OWN.match(key) or _SHARED.match(key)
        if match is None:
            continue
        if match.re is _OWN:
            layer = match["layer"]
            weight = f"{layer}.weight"
        else:  # experts sharing one adapter: their stacked weight, one item per expert
            layer = f"{match['layer']}.{match['linear']} (shared by the experts)"
            weight = f"{match['layer']}.experts.{match['linear']}.weight"
        adapter = found.setdefault(layer, Adapter(layer, weight))
        if match["matrix"] == "a":
            adapter.a = key
        else:
            adapter.b[int(match["part"] or 0)] = key
    for adapter in found.values():
        if not adapter.a or not adapter.b:
            raise UsageError(f"--adapter-only: the adapter on {adapter.layer} lacks its "
                             f"{'A' if not adapter.a else 'B'} in the checkpoint")
        if adapter.weight not in tmap.tensors and not _weight_parts(adapter, tmap):
            raise UsageError(f"--adapter-only: the adapter on {adapter.layer} adapts {adapter.weight}, which the "
                             f"provider's Hugging Face map does not place")
    return list(found.values())


def _weight_parts(adapter: Adapter, tmap: TensorMap) -> list[str]:
    """The keys the weight is saved in: itself, or its parts (Mamba's in_proj `.z .x .B .C .dt`) in saved order."""
    if adapter.weight in tmap.tensors:
        return [adapter.weight]
    return [key for key in tmap.tensors if key.startswith(f"{adapter.weight}.")]


def place(adapter: Adapter, tmap: TensorMap, loaded_modules, a: torch.Tensor, b_parts: list[torch.Tensor],
          merge: str) -> dict:
    """Loaded module path (or, for an expert's row of a 3-D parameter, its LoadedModule) -> (A, B) of one
    adapter: A [.., rank, in] and B's parts [.., rows, rank], global."""
    keys = _weight_parts(adapter, tmap)
    if len(keys) == 1 < len(b_parts):  # a gated MLP's fc1, one tensor in the map: B saved as its gate and up rows
        b_parts = [torch.cat(b_parts, dim=-2)]
    if len(keys) != len(b_parts):
        raise UsageError(f"--adapter-only: the adapter on {adapter.layer} has B in {len(b_parts)} parts, its weight "
                         f"is saved in {len(keys)}")
    sub = TensorMap({key: tmap.tensors[key] for key in keys})
    b_of = dict(zip(keys, b_parts))
    own = a.dim() - 2  # stacked axes the adapter has (layers, experts); the weight's further ones share it
    shapes = hf_shapes(sub, lambda key: _stack_sizes(sub.tensors[key]) + tuple(b_of[key].shape[-2:]))
    out, fused = {}, {}  # fused: a module several checkpoint tensors make -> [(its first row, their B rows)]
    for name, pieces in contributions(sub, shapes.__getitem__).items():
        held = loaded_modules(name)
        if isinstance(held, str):
            raise UsageError(f"--adapter-only: the adapter on {adapter.layer} cannot be exported to PEFT ({name}: "
                             f"{held}); export the merged model instead: {merge}")
        rows = max([shapes[name][0]] + [m.rows[1] for m in held if m.rows])
        b = torch.zeros(rows, a.shape[-2], dtype=b_parts[0].dtype)  # rows no adapted key fills: no delta
        index = tuple(pieces[0][1][:own])
        for key, path, (first, last), hf_rows in pieces:
            source = b_of[key][tuple(path[:own])]
            (b if hf_rows is None else b[hf_rows[0]:hf_rows[1]]).copy_(source[first:last])
        for module in held:  # a module's path, or the expert row of a 3-D parameter (peft_experts.py)
            rows_b = b if module.rows is None else b[module.rows[0]:module.rows[1]]
            if module.offset is not None:
                target = replace(module, offset=None, rows=None)
                fused.setdefault(target.path if target.parameter is None else target, []).append(
                    (module.offset, rows_b, a[index]))
                continue
            out[module.path if module.parameter is None else module] = (a[index].clone(), rows_b.clone())
    for target, parts in fused.items():  # its rows no adapted tensor fills get no delta
        b = torch.zeros(max(first + len(rows) for first, rows, _ in parts), a.shape[-2], dtype=b_parts[0].dtype)
        for first, rows, _ in parts:
            b[first:first + len(rows)] = rows
        out[target] = (parts[0][2].clone(), b)  # one adapter: the same A for every part
    return out


def _stack_sizes(spec) -> tuple:
    sizes = []
    while isinstance(spec, Stack):
        sizes.append(len(spec.items))
        spec = spec.items[0]
    return tuple(sizes)


def _derived_notes(tmap: TensorMap, adapters: list[Adapter], loaded_modules) -> list[str]:
    """Linear weights the export rebuilds from an adapted weight (RADIO's video embedder from its image embedder):
    the merged export would adapt them too, the PEFT adapter adapts the source's module only."""
    adapted = {key for adapter in adapters for key in _weight_parts(adapter, tmap)}
    return [f"{name} is rebuilt from {', '.join(keys)} at export: the PEFT adapter adapts only the latter's module"
            for name, (keys, _) in tmap.derived.items()
            if adapted & set(keys) and not isinstance(loaded_modules(name), str)]
