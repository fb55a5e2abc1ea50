"""Hugging Face model folders as a run's starting weights: a whole model (`--pretrained HF_DIR`) or parts
(`--pretrained-llm DIR`, `--pretrained-vision DIR`), and `mimo ckpt import-hf`.

The provider reads each folder's config.json (hook `hf_settings`: the settings it determines for that part) and
declares where each of the model's tensors is in it (hook `hf_tensor_map`). Here, before any worker starts and in
every worker (cheap: config.json and the safetensors headers only):

    part_settings(...)      the settings the folders determine: the base of the run's settings (over the
                            variant's defaults; an explicit setting that differs is one line per mismatch)
    check_sources(plan)     every tensor a map reads exists, every tensor of a folder has a place, non-weights
                            agree with config.json
    hf_sources_of(plan)     (what, folder, map) for the per-rank loader (hf_load.py), which each rank runs on its
                            own slices: no conversion step, under mimo's launcher, torchrun or srun alike

`mimo ckpt import-hf` (core/run/import_hf.py) and `export-hf` (hf_export.py) build on the same pieces.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from mimo.errors import UsageError
from mimo.plugins import Registry
from mimo.plugins.settings import given_settings
from mimo.plugins.kit.safetensors_io import FolderSource, is_hf_folder, read_config

from ..config import CheckpointOptions

SETTINGS_FILE = "provider.yaml"
PARTS = {"model": "--pretrained", "language": "--pretrained-llm", "vision": "--pretrained-vision"}
WHAT = {"model": "a whole model", "language": "a language model", "vision": "a vision encoder"}

__all__ = ["SETTINGS_FILE", "check_folder", "check_sources", "find_provider", "hf_sources", "hf_sources_of",
           "is_hf_folder", "part_settings", "plain_value", "precision_of", "write_settings"]


def hf_sources(options: CheckpointOptions) -> list[tuple[str, Path]]:
    """(part, folder) of every Hugging Face folder the options start from."""
    out = []
    if options.pretrained is not None and is_hf_folder(options.pretrained):
        out.append(("model", Path(options.pretrained)))
    for part, path in (("language", options.pretrained_llm), ("vision", options.pretrained_vision)):
        if path is not None:
            if not is_hf_folder(path):
                raise UsageError(f"{PARTS[part]} {path}: not a Hugging Face model folder (config.json with "
                                 f"model.safetensors or model.safetensors.index.json)")
            out.append((part, Path(path)))
    return out


def plain_value(value):
    """A setting as YAML and config.json hold it (tuples as lists), for comparing values from either."""
    return list(value) if isinstance(value, tuple) else value


def precision_of(configs) -> str:
    """The precision a Hugging Face model's config.json files say it was saved in: bf16 or fp32."""
    dtypes = {c.get("dtype") or c.get("torch_dtype") or (c.get("text_config") or {}).get("dtype") for c in configs}
    return "bf16" if "bfloat16" in dtypes else "fp32"


def write_settings(path: Path, provider: str, fields: dict) -> None:
    """A `--provider-config` file: `provider:` and the settings."""
    values = {"provider": provider, **{k: plain_value(v) for k, v in fields.items()}}
    path.write_text(yaml.safe_dump(values, sort_keys=False))


# ---------------------------------------------------------------------------------------------------- settings


def part_settings(hooks, provider: str, sources: list[tuple[str, Path]]) -> tuple[dict, dict]:
    """(settings, {setting: where it comes from}) that the folders' config.json files determine. A folder of a
    model type the provider does not read as that part, or two parts disagreeing on a setting, is one line."""
    fields, origins = {}, {}
    for part, folder in sources:
        config = read_config(folder)
        found = hooks.hf_settings(hf_config=config, part=part)
        if found is None:
            raise UsageError(f"{PARTS[part]} {folder}: provider '{provider}' does not read Hugging Face model_type "
                             f"{config.get('model_type')!r} as {WHAT[part]}")
        for name, value in found.items():
            if name in fields and plain_value(fields[name]) != plain_value(value):
                raise UsageError(f"{PARTS[part]} {folder} has {name}={value!r}, {origins[name]} has "
                                 f"{fields[name]!r}: the parts do not fit together")
            fields[name] = value
            origins[name] = f"{PARTS[part]} {folder}"
    return fields, origins


def mismatches(fields: dict, origins: dict, given: dict) -> list[str]:
    """One line per setting given explicitly (--set, --provider-config, --config) that differs from a folder's."""
    return [f"{origins[name]} has {name}={plain_value(fields[name])!r} (its config.json), this run sets "
            f"{plain_value(value)!r} ({source})"
            for name, (value, source) in given.items()
            if name in fields and plain_value(value) != plain_value(fields[name])]


def find_provider(registry: Registry, configs: dict[str, dict], name: str | None = None) -> tuple[str, dict]:
    """(provider name, settings) for config.json files by part: the named provider's, or that of the one plugin
    whose `hf_settings` reads them all (the variant whose defaults agree with the most settings)."""
    def read(provider_name):
        fields = {}
        for part, config in configs.items():
            found = registry.hooks(provider_name).hf_settings(hf_config=config, part=part)
            if found is None:
                return None, part
            fields.update(found)
        return fields, None

    types = " and ".join(repr(c.get("model_type")) for c in configs.values())
    if name is not None:
        fields, part = read(name)
        if fields is None:
            raise UsageError(f"provider '{name}' does not read Hugging Face model_type "
                             f"{configs[part].get('model_type')!r} as {WHAT[part]}")
        return name, fields
    readers = []
    for plugin in registry.plugins:
        if plugin.providers:
            fields, _ = read(plugin.providers[0].name)
            if fields is not None:
                readers.append((plugin, fields))
    if not readers:
        raise UsageError(f"no installed provider reads Hugging Face model_type {types} (see: mimo providers list)")
    if len(readers) > 1:
        names = " and ".join(f"'{p.providers[0].name}' ({p.distribution})" for p, _ in readers)
        raise UsageError(f"providers {names} both read model_type {types}: choose one with --provider")
    plugin, fields = readers[0]
    return _closest_variant(plugin.providers, fields).name, fields


def _closest_variant(providers, fields: dict):
    """Among the variants whose defaults together with `fields` are valid settings (a checkpoint's small RADIO
    position grid cannot hold a large variant's patch counts), the one agreeing with the most fields."""
    def agreement(provider):
        defaults = provider.settings(**provider.defaults)
        return sum(plain_value(getattr(defaults, k, None)) == plain_value(v) for k, v in fields.items())

    valid, first_error = [], None
    for provider in providers:
        try:
            provider.settings(**{**provider.defaults, **fields})
            valid.append(provider)
        except (TypeError, ValueError, UsageError) as err:
            first_error = first_error or f"{provider.name}: {err}"
    if not valid:
        raise UsageError(f"no variant holds the checkpoint's settings ({first_error})")
    return max(valid, key=agreement)  # the first registered among equals


# ------------------------------------------------------------------------------------------------- the folders


def hf_sources_of(plan) -> list[tuple[str, Path, object]]:
    """(what, folder, tensor map) of each Hugging Face folder the plan starts from, for hf_load.load_hf."""
    out = []
    for part, folder in hf_sources(plan.config.checkpoint):
        tmap = plan.hooks.hf_tensor_map(settings=plan.settings, hf_config=read_config(folder), part=part)
        if tmap is None:
            raise UsageError(f"{PARTS[part]} {folder}: provider '{plan.config.provider}' maps no tensors of "
                             f"Hugging Face model_type {read_config(folder).get('model_type')!r}")
        out.append((f"{PARTS[part]} {folder}", folder, tmap))
    return out


def check_sources(plan) -> None:
    """Before any worker: each map against its folder's headers. Every tensor a map reads exists; every tensor
    of the folder is read, checked or ignored by design; the checked ones (non-weights, read whole: tiny) agree
    with config.json. Shapes are checked per rank against the built model (hf_load.py)."""
    for what, folder, tmap in hf_sources_of(plan):
        with FolderSource(folder) as source:
            check_folder(what, tmap, source)


def check_folder(what: str, tmap, source) -> None:
    """`tmap` against the tensors `source` holds (names and headers; the checked non-weights read whole)."""
    names = set(source.names())
    if missing := sorted(tmap.names() - names):
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UsageError(f"{what} has no tensor {missing[0]}{more}, which these settings need (does its config.json "
                         f"describe its tensors?)")
    unused = sorted(n for n in names - tmap.names() - set(tmap.checks) if not n.startswith(tmap.ignored))
    if unused:
        more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
        raise UsageError(f"{what} has tensor {unused[0]}{more}, which the model has no place for")
    for name, check in tmap.checks.items():
        if name in names and (problem := check(source.read(name))):
            raise UsageError(f"{what}: tensor {name} {problem}")


def hf_base_settings(config, provider, hooks) -> dict:
    """The settings the run's Hugging Face folders determine (--pretrained HF_DIR, --pretrained-llm,
    --pretrained-vision), over which explicit settings may not differ: all mismatches, one line each."""
    sources = hf_sources(config.checkpoint)
    if not sources:
        return {}
    fields, origins = part_settings(hooks, config.provider, sources)
    given = given_settings(provider, config.provider_settings, config.provider_config, config.provider_values,
                           config.config_file)
    if lines := mismatches(fields, origins, given):
        raise UsageError("\n".join(lines))
    return fields
