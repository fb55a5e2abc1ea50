"""What a checkpoint says about the run that wrote it, honoured by `mimo eval` and `mimo generate`.

A mimo checkpoint records its provider, every setting and the loop options (common.pt's `run`, also run.yaml); a
Hugging Face folder gives a provider (the one whose `hf_settings` reads its config.json) and the settings that
config implies. The commands that read a checkpoint take these instead of the defaults:

1. the provider is the saved one; a `--provider` naming another is one line;
2. settings: the provider's defaults < the saved settings < `--set` (each `--set` that changes a saved value is
   printed); a `--provider-config` (or a `--config` file's settings) that disagrees with a saved value is one line;
3. loop options the user did not give come from the saved run where they decide the figures: `mimo eval` takes the
   precision, the batch sizes, the data and the evaluation's size; `mimo generate` the precision.

`mimo run --load` resuming a mimo checkpoint takes its provider and settings too, but goes on as it was trained: a
`--set` that changes a saved setting is one line (its loop options stay the command line's).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from mimo.errors import UsageError
from mimo.plugins import Registry
from mimo.plugins.settings import SETTINGS_FILE_OPTION, build_settings, given_settings, settings_file_values

from ..config import RunConfig
from . import adapter_state
from .hf import find_provider, is_hf_folder, plain_value, precision_of
from .layout import RUN_FILE, iteration_dir, read_common, read_tracker

# Loop options each command takes from the checkpoint when the user gives none: {section: (options)}.
# A LoRA run's checkpoint holds adapters that only its --lora-* options rebuild.
_ADAPTERS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "lora_experts")
INHERITED = {
    "eval": {"training": ("precision", "micro_batch_size", "global_batch_size", "num_microbatches"),
             "data": ("data", "num_workers", "pack_sequences", "packing_buffer_size"),
             "evaluation": ("eval_data", "eval_iters"), "adapters": _ADAPTERS},
    "generate": {"training": ("precision",), "adapters": _ADAPTERS},
    "run": {"adapters": _ADAPTERS},  # a resumed run: the saved settings, and a LoRA run's adapters
}
_BATCH = ("micro_batch_size", "global_batch_size", "num_microbatches")  # taken together or not at all


@dataclass(frozen=True)
class SavedRun:
    source: str  # the checkpoint's directory, for messages
    provider: str
    settings: dict  # every setting as saved (plain values)
    options: dict  # {section: {option: value}} of the run that saved it; {} for a Hugging Face folder
    llm_dp: int | None = None  # the LLM's data-parallel size then
    adapter_base: dict | None = None  # a LoRA checkpoint's record of its base (adapter_state.base_record)


def saved_run(path: Path | None, provider: str | None = None, registry: Registry | None = None) -> SavedRun | None:
    """The run a mimo checkpoint or a Hugging Face folder at `path` describes; None for anything else (a
    checkpoint of another framework: the command line alone decides)."""
    if path is None or not Path(path).exists():
        return None
    path = Path(path)
    iteration = read_tracker(path)
    if iteration is not None:
        directory = iteration_dir(path, iteration)
        if not (directory / "common.pt").is_file():
            return None
        common = read_common(directory)
        run = common.get("run")
        if not isinstance(run, dict) or "provider" not in run:
            return None  # a dist checkpoint that mimo did not write
        layout = (run.get("layout") or {}).get("language") or {}
        record = common.get("adapters") if (common.get("contents") or {}).get("adapters") else None
        return SavedRun(str(directory), run["provider"], dict(run.get("settings") or {}),
                        dict(run.get("options") or {}), layout.get("dp"), record)
    if is_hf_folder(path):
        from mimo.plugins.kit import safetensors_io

        registry = registry or Registry()
        hf_config = safetensors_io.read_config(path)
        name, fields = find_provider(registry, {"model": hf_config}, provider)
        settings = dict(fields)
        setting_names = {f.name for f in dataclasses.fields(registry.get(name)[0].settings)}
        if (path / "tokenizer.json").is_file() and "tokenizer_path" in setting_names:
            settings.setdefault("tokenizer_path", str(path))  # the folder's own tokenizer
        return SavedRun(str(path), name, settings, {"training": {"precision": precision_of([hf_config])}})
    return None


def honour(config: RunConfig, saved: SavedRun, given: set[str], command: str) -> RunConfig:
    """`config` with the checkpoint's provider, settings and inherited loop options (`given`: the options the user
    typed or wrote in a --config file, which win). UsageError on a conflict."""
    if config.provider != saved.provider:
        raise UsageError(f"--provider {config.provider}, but {saved.source} was saved by provider "
                         f"'{saved.provider}': drop --provider")
    provider, _ = Registry().get(saved.provider)
    reference = build_settings(provider, run_file_values=saved.settings, run_file=Path(saved.source))
    for option, source, values in _settings_files(config, provider):
        wanted = build_settings(provider, run_file_values=values, run_file=source)
        for key in values:
            value, had = plain_value(getattr(wanted, key)), plain_value(getattr(reference, key))
            if value != had:
                override = "" if command == "run" else f" or override with --set {key}={value}"
                raise UsageError(f"{option} {source} sets {key}={value}, but {saved.source} was saved with {had}: "
                                 f"drop {option} (the checkpoint's settings are used){override}")
    parts = {}
    for section, names in INHERITED[command].items():
        current = getattr(config, section)
        saved_section = saved.options.get(section) or {}
        chosen = {}
        for name in names:
            if name not in saved_section or name in given:
                continue
            if name in _BATCH and given & set(_BATCH):
                continue
            chosen[name] = _typed(current, name, saved_section[name])
        if section == "evaluation" and not chosen.get("eval_iters"):
            chosen.pop("eval_iters", None)  # a run without evaluations: the command's default
        if section == "training" and "global_batch_size" in chosen and chosen["global_batch_size"] is None \
                and saved.llm_dp and chosen.get("micro_batch_size"):
            chosen["global_batch_size"] = chosen["micro_batch_size"] * saved.llm_dp * \
                (chosen.pop("num_microbatches", None) or 1)  # the run's global batch, whatever the layout now
        for name in ("data", "eval_data"):
            if chosen.get(name) is not None and not Path(chosen[name]).exists():
                raise UsageError(f"{saved.source} was trained with --{name.replace('_', '-')} {chosen[name]}, which "
                                 f"is not here: give --{name.replace('_', '-')} DIR")
        parts[section] = dataclasses.replace(current, **chosen)
    # the saved settings take the place of a --config file's (checked equal above); errors name the checkpoint
    return dataclasses.replace(config, provider_values=dict(saved.settings), config_file=Path(saved.source),
                               **parts)


def recorded_base(config: RunConfig, saved: SavedRun, given: set[str], command: str) -> tuple[RunConfig, str | None]:
    """A LoRA checkpoint's base where the command line names none: the folders its record names, checked now (still
    there, the same weights; one line otherwise), or the seed of the initialization the adapters were trained on.
    Returns the config and the line saying which base (None: no adapters, or a base given, which the load checks
    against the record)."""
    record = saved.adapter_base
    c = config.checkpoint
    if record is None or any(getattr(c, name) is not None for name in adapter_state.BASE_OPTIONS):
        return config, None
    bases = adapter_state.recorded_base(record, Path(saved.source))
    if bases:
        config = dataclasses.replace(config, checkpoint=dataclasses.replace(c, **bases))
    elif record.get("seed") is not None and (command == "generate" or "seed" not in given):
        # generate's --seed is its sampling's: the model is built from the seed the adapters were trained on
        config = dataclasses.replace(config, training=dataclasses.replace(config.training, seed=record["seed"]))
    checked = ", unchanged since" if bases else ""
    return config, f"mimo {command}: base {adapter_state.describe(record)}, recorded by {saved.source}{checked}"


def refuse_changed_settings(config: RunConfig, saved: SavedRun) -> None:
    """A resumed run keeps the checkpoint's settings: a `--set` that changes one is one line naming both values."""
    provider, _ = Registry().get(saved.provider)
    reference = build_settings(provider, run_file_values=saved.settings, run_file=Path(saved.source))
    for key, (value, _) in given_settings(provider, config.provider_settings).items():
        had = plain_value(getattr(reference, key))
        if plain_value(value) != had:
            raise UsageError(f"--set {key}={plain_value(value)}, but {saved.source} was saved with {key}={had} "
                             f"({Path(saved.source) / RUN_FILE} holds every setting it was trained with): a resumed "
                             f"run keeps them; drop --set {key}, or start a new run from these weights with "
                             f"--pretrained instead of --load")


def report_lines(plan, saved: SavedRun, typed: RunConfig, honoured: RunConfig, command: str) -> list[str]:
    """What the command took from the checkpoint (`typed`: the config before `honour`, `honoured`: after) and which
    `--set` overrode a saved setting."""
    lines = []
    for assignment in plan.config.provider_settings:
        key = assignment.partition("=")[0].strip()
        have, had = plain_value(getattr(plan.settings, key, None)), plain_value(saved.settings.get(key))
        if have != had:
            lines.append(f"mimo {command}: {key}={have} (--set; {saved.source} has {had})")
    inherited = [f"{name}={getattr(getattr(honoured, section), name)}"
                 for section, names in INHERITED[command].items() for name in names
                 if getattr(getattr(honoured, section), name) != getattr(getattr(typed, section), name)]
    lines.append(f"mimo {command}: provider {saved.provider}, its settings" +
                 (f" and {', '.join(inherited)}" if inherited else "") + f" from {saved.source}")
    return lines


def _typed(options, name: str, value):
    """A saved option's value in its field's type (paths were saved as text)."""
    current = getattr(options, name)
    if value is not None and (isinstance(current, Path) or name in ("data", "eval_data")):
        return Path(value)
    return value


def _settings_files(config: RunConfig, provider) -> list[tuple[str, Path, dict]]:
    """(option, file, the settings it sets) of the --provider-config file and of a --config file's settings."""
    found = []
    if config.provider_config is not None:
        path = Path(config.provider_config)
        found.append((SETTINGS_FILE_OPTION, path, settings_file_values(provider, path)))
    if config.config_file is not None and config.provider_values:
        found.append(("--config", Path(config.config_file), dict(config.provider_values)))
    return found

