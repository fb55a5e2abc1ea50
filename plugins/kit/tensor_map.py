"""Where each tensor of a mimo model is in a Hugging Face checkpoint, declared once for import, per-rank loading and
export.

A converter declares, for every dist-checkpoint key of its modules (the `ShardedTensor.key` a mimo checkpoint
saves, without the DDP wrapper's `module.`), where that key's *global* tensor lies among the checkpoint's tensors:

    Src(name, rows=None)    a Hugging Face tensor, or the window [rows[0], rows[1]) of its dim 0
    Cat(parts)              dim 0 is the parts' rows one after another (q/k/v grouped per head group)
    Stack(items)            a leading axis indexes the items (experts; a transformer block's layers)

Nothing is converted up front: a rank asks for the hyper-rectangle its parameter holds (`read_into`), which
resolves to row windows of Hugging Face tensors read straight from their files; export walks the same declaration
backwards (`contributions`). Transforms that commute with slicing are all that Nemotron-H, RADIO and the omni
projector need (no transpose, no interpolation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Union

import torch

from mimo.errors import UsageError

Index = tuple[tuple[int, int], ...]  # (start, stop) per dim


@dataclass(frozen=True)
class Src:
    """A Hugging Face tensor, or the window [rows[0], rows[1]) of its dim 0."""

    name: str
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class Cat:
    """Dim 0 of the mimo tensor: the parts' rows, one part after another."""

    parts: tuple


@dataclass(frozen=True)
class Stack:
    """A new leading axis of the mimo tensor indexes these items."""

    items: tuple


Spec = Union[Src, Cat, Stack]


def prefixed(spec: Spec, prefix: str) -> Spec:
    """`spec` with `prefix` before each Hugging Face name it reads (a layer's map placed at its layer's path)."""
    if isinstance(spec, Src):
        return Src(prefix + spec.name, spec.rows)
    if isinstance(spec, Cat):
        return Cat(tuple(prefixed(p, prefix) for p in spec.parts))
    return Stack(tuple(prefixed(i, prefix) for i in spec.items))


@dataclass
class TensorMap:
    """One part of a model (or a whole model) against one Hugging Face folder.

    tensors  dist key -> Spec: where the key's global tensor is
    covers   key prefixes this map must cover completely: a model key under them that has no entry is an error
             (never left at its initial value); keys under no map's `covers` start from initialization
    checks   Hugging Face tensors that are no weights: read whole (they are tiny) and checked against the config;
             fn(tensor) returns an error text or None
    ignored  Hugging Face name prefixes that have no place in the model by design (`mtp.`, `audio_tower.`)
    derived  export only: Hugging Face tensors rebuilt rather than read, name -> (dist keys, fn(*their global
             tensors) -> tensor); keys () for constants from the config
    """

    tensors: dict = field(default_factory=dict)
    covers: tuple = ()
    checks: dict = field(default_factory=dict)
    ignored: tuple = ()
    derived: dict = field(default_factory=dict)

    def prefixed(self, key_prefix: str, hf_prefix: str) -> "TensorMap":
        """This map with `key_prefix` before every key and `hf_prefix` before every Hugging Face name."""
        def move(spec):
            if isinstance(spec, Src):
                return Src(hf_prefix + spec.name, spec.rows)
            if isinstance(spec, Cat):
                return Cat(tuple(move(p) for p in spec.parts))
            return Stack(tuple(move(i) for i in spec.items))

        return TensorMap({key_prefix + k: move(s) for k, s in self.tensors.items()},
                         tuple(key_prefix + c for c in self.covers),
                         {hf_prefix + n: c for n, c in self.checks.items()},
                         tuple(hf_prefix + p for p in self.ignored),
                         {hf_prefix + n: (tuple(key_prefix + k for k in keys), fn)
                          for n, (keys, fn) in self.derived.items()})

    def merged(self, *others: "TensorMap") -> "TensorMap":
        out = dataclasses.replace(self, tensors=dict(self.tensors), checks=dict(self.checks),
                                  derived=dict(self.derived))
        for other in others:
            out.tensors.update(other.tensors)
            out.checks.update(other.checks)
            out.derived.update(other.derived)
            out.covers += other.covers
            out.ignored += other.ignored
        return out

    def covered(self, key: str) -> bool:
        return key.startswith(self.covers) if self.covers else False

    def names(self) -> set[str]:
        """Every Hugging Face tensor a Src reads."""
        return {leaf.name for spec in self.tensors.values() for leaf in leaves(spec)}


@dataclass(frozen=True)
class LoadedModule:
    """A linear module of the model transformers loads from the export (named as transformers names it after its
    load-time renaming: what PEFT's `target_modules` match), whose weight is the rows [rows[0], rows[1]) of a
    checkpoint tensor (None: all of it). Or, with `parameter`, a module holding experts' weights as 3-D parameters
    [experts, out, in] (what PEFT's `target_parameters` adapt): the checkpoint tensor is row `expert` of
    `parameter`; `parameters` lists the module's 3-D parameters in their registration order (PEFT nests its
    wrappers in that order, which names their adapter tensors). `offset`: the module fuses several checkpoint
    tensors (Qwen's experts' `gate_up_proj` of `gate_proj` and `up_proj`): this one's rows start at row `offset`
    of the module's weight."""

    path: str
    rows: tuple[int, int] | None = None
    parameter: str | None = None
    expert: int | None = None
    parameters: tuple[str, ...] = ()
    offset: int | None = None


@dataclass
class HFExport:
    """What `hf_export` gives for a model's settings: config.json, the map of the exported tensors, other files of
    the folder (name -> text or bytes: tokenizer, processor, generation config) and notes for the user (one line
    each: what the export had to make up).

    `loaded_modules` (optional) lets `export-hf --adapter-only` write LoRA adapters as a PEFT adapter: for the
    name of a linear's weight among the exported tensors, the `LoadedModule`s that hold its rows once transformers
    loaded the folder, or a sentence saying why no module PEFT adapts does (e.g. experts loaded as one 3-D tensor).
    None: the provider's adapters are exported merged only (`mimo ckpt merge-lora`, then `export-hf`)."""

    config: dict
    tensors: TensorMap
    files: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    loaded_modules: Callable[[str], "tuple[LoadedModule, ...] | str"] | None = None


def leaves(spec: Spec) -> Iterator[Src]:
    if isinstance(spec, Src):
        yield spec
    else:
        for sub in spec.parts if isinstance(spec, Cat) else spec.items:
            yield from leaves(sub)


def shape_of(spec: Spec, hf_shape: Callable[[str], tuple]) -> tuple:
    """The global shape `spec` gives, from the Hugging Face tensors' shapes; UsageError when the parts disagree."""
    if isinstance(spec, Src):
        shape = tuple(hf_shape(spec.name))
        if spec.rows is None:
            return shape
        if not shape or spec.rows[1] > shape[0]:
            raise UsageError(f"Hugging Face tensor {spec.name} has shape {list(shape)}, too small for rows "
                             f"{spec.rows[0]}:{spec.rows[1]}")
        return (spec.rows[1] - spec.rows[0],) + shape[1:]
    if isinstance(spec, Cat):
        shapes = [shape_of(p, hf_shape) for p in spec.parts]
        if any(s[1:] != shapes[0][1:] for s in shapes):
            raise UsageError(f"Hugging Face tensors {sorted({leaf.name for leaf in leaves(spec)})} have shapes "
                             f"that do not concatenate: {[list(s) for s in shapes][:4]}")
        return (sum(s[0] for s in shapes),) + shapes[0][1:]
    shapes = [shape_of(i, hf_shape) for i in spec.items]
    if any(s != shapes[0] for s in shapes):
        raise UsageError(f"Hugging Face tensors {[leaf.name for leaf in leaves(spec)][:4]} differ in shape: "
                         f"{[list(s) for s in shapes][:4]}")
    return (len(shapes),) + shapes[0]


def read_into(spec: Spec, index: Index, out: torch.Tensor, source) -> None:
    """out = the global tensor `spec` declares, at `index`; `source` reads Hugging Face tensors' hyper-rectangles
    (`source.read_into(name, index, out)`, `source.shape(name)`)."""
    (a, b), rest = index[0], index[1:]
    if isinstance(spec, Stack):
        for i in range(a, b):
            read_into(spec.items[i], rest, out[i - a], source)
    elif isinstance(spec, Cat):
        pos = 0
        for part in spec.parts:
            n = shape_of(part, source.shape)[0]
            lo, hi = max(a, pos), min(b, pos + n)
            if lo < hi:
                read_into(part, ((lo - pos, hi - pos),) + rest, out[lo - a:hi - a], source)
            pos += n
    else:
        first = spec.rows[0] if spec.rows else 0
        source.read_into(spec.name, ((first + a, first + b),) + rest, out)


# ------------------------------------------------------------------------------------------- export (inverse)


def hf_shapes(tmap: TensorMap, key_shape: Callable[[str], tuple]) -> dict[str, tuple]:
    """Each Hugging Face tensor's shape from the global shapes of the keys that hold it (a window's tensor is as
    long as its furthest window reaches)."""
    shapes: dict[str, tuple] = {}

    def walk(spec, shape):
        if isinstance(spec, Stack):
            for item in spec.items:
                walk(item, shape[1:])
        elif isinstance(spec, Cat):
            for part in spec.parts:
                if not isinstance(part, Src) or part.rows is None:
                    raise ValueError("export needs every Cat part to be a Src with rows")
                walk(part, (part.rows[1] - part.rows[0],) + tuple(shape[1:]))
        elif spec.rows is None:
            shapes[spec.name] = tuple(shape)
        else:
            known = shapes.get(spec.name, (0,) + tuple(shape[1:]))
            shapes[spec.name] = (max(known[0], spec.rows[1]),) + tuple(shape[1:])

    for key, spec in tmap.tensors.items():
        walk(spec, tuple(key_shape(key)))
    return shapes


def contributions(tmap: TensorMap, hf_shape: Callable[[str], tuple]) -> dict[str, list]:
    """Hugging Face name -> [(dist key, stack path, key rows (a, b), hf rows (c, d) or None)]: which rows of
    which key (after indexing the stacked axes by `path`) make up which rows of the tensor."""
    out: dict[str, list] = {}

    def walk(key, spec, path, row0):
        if isinstance(spec, Stack):
            for i, item in enumerate(spec.items):
                walk(key, item, path + (i,), 0)
            return 0
        if isinstance(spec, Cat):
            pos = row0
            for part in spec.parts:
                pos += walk(key, part, path, pos)
            return pos - row0
        n = (spec.rows[1] - spec.rows[0]) if spec.rows else hf_shape(spec.name)[0]
        out.setdefault(spec.name, []).append((key, path, (row0, row0 + n), spec.rows))
        return n

    for key, spec in tmap.tensors.items():
        walk(key, spec, (), 0)
    return out


def hf_tensor(pieces: list, tensors: dict, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """One Hugging Face tensor assembled from its `contributions` pieces out of global key tensors."""
    out = torch.empty(shape, dtype=dtype)
    for key, path, (a, b), rows in pieces:
        source = tensors[key]
        for i in path:
            source = source[i]
        (out if rows is None else out[rows[0]:rows[1]]).copy_(source[a:b])
    return out


def components(contrib: dict[str, list]) -> list[list[str]]:
    """Groups of Hugging Face names that share keys (one attention layer's q, k, v and its fused key; one layer's
    experts and the stacked key): each group is converted from the keys it needs alone. In first-seen order."""
    parent: dict = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for name, pieces in contrib.items():
        for key, *_ in pieces:
            parent[find(("hf", name))] = find(("key", key))
    groups: dict = {}
    for name in contrib:
        groups.setdefault(find(("hf", name)), []).append(name)
    return list(groups.values())


def to_hf(tmap: TensorMap, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every Hugging Face tensor of `tmap` (derived ones included) from the global tensors of its keys: the whole
    conversion in memory, for models small enough (tests, the contract kit)."""
    shapes = hf_shapes(tmap, lambda key: tuple(tensors[key].shape))
    contrib = contributions(tmap, shapes.__getitem__)
    dtype = {name: tensors[pieces[0][0]].dtype for name, pieces in contrib.items()}
    out = {name: hf_tensor(contrib[name], tensors, shapes[name], dtype[name]) for name in contrib}
    out.update({name: fn(*(tensors[k] for k in keys)) for name, (keys, fn) in tmap.derived.items()})
    return out
