"""Triton's autotuning at the first iterations: pin recorded choices, record the new ones, report what compiled.

Which kernels are the provider's to say (hook `kernel_configs`, a `mimo.plugins.KernelConfigs`: the modules whose
autotuned kernels to pin and record, and its recorded tables). Nemotron's, for example: mamba-ssm autotunes its
Mamba-2 (SSD) kernels at first use, 15 of them over about 114 configs for the training call megatron-core makes,
and transformer-engine its token-permutation kernels; each config is compiled (ptxas) and timed. That is most of a
Nemotron run's first iteration on a fresh machine. Their autotune keys hold the model's widths and the tensors'
dtypes, never batch or sequence length, so one recorded choice per kernel and width serves every micro-batch and
every packed length. Pinning fills `Autotuner.cache[key]`, which `Autotuner.run` consults before benchmarking: a
pinned key compiles one config; a key without a pin (another width or dtype) autotunes as before and is recorded.
A config is pinned only when it is one of the kernel's own configs (another version's list just autotunes), and a
table recorded on another GPU model is used only for the same compute capability.

Triton's own disk cache of autotune results (TRITON_CACHE_AUTOTUNING) skips kernels whose configs carry a
`pre_hook`, 4 of mamba-ssm's; the tables here cover those too.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

from mimo.wording import counted

FIELDS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def autotuners(modules) -> dict:
    """{module.attribute: triton Autotuner} of the kernels in `modules` (the provider's, hook `kernel_configs`)
    that import here; a module whose package is absent or broken is skipped."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return {}
    found = {}
    for name in modules:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an absent or broken optional package has nothing to pin
            continue
        for attr, value in vars(module).items():
            if isinstance(value, Autotuner):
                found[f"{name}.{attr}"] = value
    return found


def config_dict(config) -> dict:
    return {"kwargs": dict(config.kwargs), **{f: getattr(config, f, None) for f in FIELDS}}


def _json_key(key) -> list | None:
    if not all(isinstance(part, (bool, int, str)) or part is None for part in key):
        return None  # not faithfully serializable: left to autotuning
    return list(key)


def record(gpu: str, capability: str, tuners: dict) -> dict:
    """The autotune choices this process made or was given in `tuners` (`autotuners`), as a table `pin` reads."""
    import triton

    kernels = {}
    for name, tuner in tuners.items():
        rows = [{"key": k, "config": config_dict(c)}
                for k, c in ((_json_key(key), config) for key, config in tuner.cache.items()) if k is not None]
        if rows:
            kernels[name] = rows
    return {"gpu": gpu, "capability": capability, "triton": triton.__version__, "kernels": kernels}


def pin(tables: list[dict], gpu: str, capability: str, tuners: dict) -> tuple[int, list[str]]:
    """Fill the caches of `tuners` (`autotuners`) from `tables` (a table recorded on this GPU model first, then on
    others of the same compute capability; an earlier table wins a key). Returns (keys pinned, notes on what was
    left out)."""
    pinned, notes = 0, []
    ordered = sorted(tables, key=lambda t: t.get("gpu") != gpu)
    for table in ordered:
        if table.get("gpu") != gpu and table.get("capability") != capability:
            notes.append(f"a table recorded on {table.get('gpu')} (compute capability {table.get('capability')}) "
                         f"does not apply to {gpu} ({capability})")
            continue
        for name, rows in table.get("kernels", {}).items():
            tuner = tuners.get(name)
            if tuner is None:
                continue
            for row in rows:
                match = [c for c in tuner.configs if config_dict(c) == row["config"]]
                key = tuple(row["key"])
                if not match:
                    notes.append(f"{name.rsplit('.', 1)[-1]}: a recorded config is not among this version's")
                elif key not in tuner.cache:
                    tuner.cache[key] = match[0]
                    pinned += 1
    return pinned, notes


def merge(old: dict | None, new: dict) -> dict:
    """`new`'s rows over `old`'s (same GPU model), kernel by kernel and key by key."""
    if not old or old.get("gpu") != new.get("gpu"):
        return new
    kernels = {name: {json.dumps(r["key"]): r for r in rows} for name, rows in old.get("kernels", {}).items()}
    for name, rows in new["kernels"].items():
        kernels.setdefault(name, {}).update({json.dumps(r["key"]): r for r in rows})
    return {**new, "kernels": {name: list(rows.values()) for name, rows in kernels.items()}}


def read_table(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_table(path: Path, table: dict) -> None:
    """Merge `table` into the one at `path`, written whole or not at all (ranks and nodes may share the file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = merge(read_table(path), table)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    scratch.write_text(json.dumps(merged, indent=1))
    os.replace(scratch, path)


class CompileReport:
    """Counts and times, while active, what Triton compiles: autotuning of a new key (every config compiled and
    timed, or a disk-cache hit) and plain JIT compiles (through `triton.knobs.runtime` hooks where this Triton has
    them), and what torch.compile compiled. `line()` says it in one line."""

    def __init__(self):
        self.tuned: list[tuple[str, float, int]] = []  # (kernel, seconds, configs timed; 0: a cache hit)
        self.compiled: list[tuple[str, float]] = []  # plain JIT compiles (or disk loads) outside autotuning
        self._undo = []
        self._inside_autotune = threading.local()
        self._compile_started: dict[int, float] = {}
        self._dynamo_before = _dynamo_seconds()

    def start(self) -> CompileReport:
        try:
            from triton.runtime.autotuner import Autotuner
        except ImportError:
            return self
        original, report = Autotuner.run, self

        def run(tuner, *args, **kwargs):
            before, timings = len(tuner.cache), getattr(tuner, "configs_timings", None)
            report._inside_autotune.active = True
            started = time.perf_counter()
            try:
                return original(tuner, *args, **kwargs)
            finally:
                report._inside_autotune.active = False
                if len(tuner.cache) > before:
                    now = getattr(tuner, "configs_timings", None)
                    timed = len(now) if now is not None and now is not timings else 0
                    report.tuned.append((tuner.base_fn.__name__, time.perf_counter() - started, timed))

        Autotuner.run = run
        self._undo.append(lambda: setattr(Autotuner, "run", original))
        self._hook_jit()
        return self

    def _hook_jit(self) -> None:
        try:
            from triton import knobs

            runtime = knobs.runtime
            cache_hook, post_hook = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        except (ImportError, AttributeError):
            return
        report = self

        def before(*args, **kwargs):
            report._compile_started[threading.get_ident()] = time.perf_counter()
            return cache_hook(*args, **kwargs) if cache_hook else None  # truthy would skip the compile

        def after(*args, **kwargs):
            started = report._compile_started.pop(threading.get_ident(), None)
            if started is not None and not getattr(report._inside_autotune, "active", False):
                fn = kwargs.get("fn")
                report.compiled.append((getattr(fn, "name", "kernel"), time.perf_counter() - started))
            return post_hook(*args, **kwargs) if post_hook else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after

        def undo():
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = cache_hook, post_hook

        self._undo.append(undo)

    def stop(self) -> None:
        while self._undo:
            self._undo.pop()()

    def line(self, pinned: int, torch_compile: bool) -> str:
        """E.g. `Triton: 15 kernels autotuned in 61.2 s (114 configs timed), 9 compiled in 4.1 s, 17 pinned;
        slowest _chunk_scan_bwd_dx 9.0 s; torch.compile off`."""
        parts = []
        if self.tuned:
            seconds, timed = sum(t for _, t, _ in self.tuned), sum(n for _, _, n in self.tuned)
            parts.append(f"{counted(len(self.tuned), 'kernel')} autotuned in {seconds:.1f} s "
                         f"({counted(timed, 'config')} timed)")
        if self.compiled:
            parts.append(f"{len(self.compiled)} compiled or loaded in {sum(t for _, t in self.compiled):.1f} s")
        if pinned:
            parts.append(f"{counted(pinned, 'choice')} pinned")
        slowest = sorted([(n, t) for n, t, _ in self.tuned] + self.compiled, key=lambda x: -x[1])[:2]
        text = "Triton: " + (", ".join(parts) if parts else "nothing compiled")
        if slowest and slowest[0][1] >= 1.0:
            text += "; slowest " + ", ".join(f"{n} {t:.1f} s" for n, t in slowest)
        if torch_compile:
            graphs, seconds = _dynamo_graphs(), _dynamo_seconds() - self._dynamo_before
            text += f"; torch.compile: {graphs} graphs in {seconds:.1f} s"
        else:
            text += "; torch.compile off"
        return text


def _dynamo_seconds() -> float:
    if "torch._dynamo" not in sys.modules:
        return 0.0
    from torch._dynamo import utils

    return float(sum(getattr(utils, "compilation_time_metrics", {}).get("_compile.compile_inner", [])))


def _dynamo_graphs() -> int:
    from torch._dynamo import utils

    return int(utils.counters["stats"]["unique_graphs"])
