"""What a run compiles, where it keeps it, and what the first iteration says about it.

`configure` (before the model is built): torch.compile on or off (`--torch-compile`, off by default: megatron-core's
fused functions run eagerly), and on a GPU the caches a later run reuses under `--compile-cache` (default
$MIMO_COMPILE_CACHE, else ~/.cache/mimo/compile): Triton's compiled kernels and autotune timings in `triton/`,
inductor's graphs in `inductor/`, and the autotune choices mimo records in `kernel_configs.json`.

`FirstIterations` (around the first iterations of a run): pins recorded Triton autotune choices (the provider's
tables, the cache's, `--kernel-configs`), says on the console what iteration 1 compiled and for how long, records
the choices for the next run, and with `MIMO_STACK_DUMP_S=N` in the environment dumps every thread's stack each N
seconds during iterations 1 and 2 (to find where a slow first iteration spends its time).
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch

from mimo.plugins import KernelConfigs

from . import kernel_tuning

CACHE_ENV = "MIMO_COMPILE_CACHE"
STACK_DUMP_ENV = "MIMO_STACK_DUMP_S"
TABLE_FILE = "kernel_configs.json"


def cache_dir(options) -> Path:
    """--compile-cache, else $MIMO_COMPILE_CACHE, else ~/.cache/mimo/compile."""
    if options.compile_cache is not None:
        return Path(options.compile_cache).expanduser()
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mimo" / "compile").expanduser()


def configure(options, device: torch.device) -> None:
    """Before the model is built: torch.compile on or off; on a GPU, the caches' places. An explicit
    --compile-cache overrides TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR; otherwise those win where set."""
    import torch._dynamo

    seconds = os.environ.get(STACK_DUMP_ENV)
    if seconds and float(seconds) > 0:  # a start-up that hangs says where, rank by rank (cancelled after iteration 2)
        faulthandler.dump_traceback_later(float(seconds), repeat=True, file=sys.stderr)
    torch._dynamo.config.disable = options.torch_compile != "on"
    if device.type != "cuda":
        return
    root = cache_dir(options)
    put = os.environ.__setitem__ if options.compile_cache is not None else os.environ.setdefault
    put("TRITON_CACHE_DIR", str(root / "triton"))
    put("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # Triton >= 3.4: autotune timings beside the kernels


class FirstIterations:
    """Pins before iteration 1, the compile report after it, the recorded choices after it and at the end."""

    def __init__(self, options, *, hooks, settings, device: torch.device, speaks: bool):
        """`speaks`: this rank prints the run's lines; the node's first rank (LOCAL_RANK 0) writes the table."""
        self.options, self.device, self.speaks = options, device, speaks
        self.hooks, self.settings = hooks, settings
        self.writes = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0))) == 0
        self.report: kernel_tuning.CompileReport | None = None
        self.tuners: dict = {}  # the provider's autotuned kernels, found before the first iteration
        self.pinned, self.notes, self.first = 0, [], None
        self._dumping = False

    @property
    def table(self) -> Path:
        return cache_dir(self.options) / TABLE_FILE

    def before(self, iteration: int) -> None:
        """Call before each iteration; acts before the first this process runs."""
        if self.first is not None:
            return
        self.first = iteration
        seconds = os.environ.get(STACK_DUMP_ENV)
        if seconds and float(seconds) > 0:
            faulthandler.dump_traceback_later(float(seconds), repeat=True, file=sys.stderr)
            self._dumping = True
        if self.device.type != "cuda":
            return
        try:
            provided = KernelConfigs.of(self.hooks.kernel_configs(settings=self.settings))
            self.tuners = tuners = kernel_tuning.autotuners(provided.modules)
            if os.environ.get("TRITON_CACHE_AUTOTUNING") == "1":  # kernels made before configure() read it at import
                for tuner in tuners.values():
                    tuner.cache_results = True
            gpu, capability = _gpu(self.device)
            self.pinned, self.notes = kernel_tuning.pin(self._tables(provided), gpu, capability, tuners)
            self.report = kernel_tuning.CompileReport().start()
        except Exception as err:  # noqa: BLE001 - an unexpected Triton or table costs the pins, not the run
            if self.speaks:
                print(f"kernel choices not pinned ({type(err).__name__}: {err}); kernels autotune at first use",
                      flush=True)
            return
        triton_dir = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
        if self.speaks and not (triton_dir.is_dir() and any(triton_dir.iterdir())):
            print(f"iteration {iteration} compiles GPU kernels into an empty cache ({triton_dir}); later runs load "
                  f"them from there (--compile-cache)", flush=True)

    def _tables(self, provided: KernelConfigs) -> list[dict]:
        """The provider's tables, the cache's and --kernel-configs' (none: no pins)."""
        given = self.options.kernel_configs
        if given == "none":
            return []
        tables = list(provided.tables)
        for path in (self.table, Path(given) if given else None):
            table = kernel_tuning.read_table(path) if path is not None and path.is_file() else None
            if table is not None:
                tables.insert(0, table)  # the run's own records before the provider's
        return tables

    def after(self, iteration: int, seconds: float) -> None:
        """Call after each iteration with its seconds."""
        if iteration == self.first and self.report is not None:
            if self.speaks:
                note = f" ({self.notes[0]})" if self.notes else ""
                print(f"first iteration {seconds:.1f} s: {self.report.line(self.pinned, self._compiles())}; kernel "
                      f"cache {cache_dir(self.options)}{note}", flush=True)
            self.save()
        if iteration == self.first + 1 and self.report is not None:
            self.report.stop()  # its wrappers would cost every later launch of an autotuned kernel a little
        if self._dumping and iteration >= self.first + 1:
            faulthandler.cancel_dump_traceback_later()
            self._dumping = False

    def _compiles(self) -> bool:
        return self.options.torch_compile == "on"

    def save(self) -> None:
        """Merge this process's autotune choices into the cache's table (the node's first rank)."""
        if self.report is None or not self.writes:
            return
        try:
            kernel_tuning.write_table(self.table, kernel_tuning.record(*_gpu(self.device), self.tuners))
        except (OSError, TypeError, ValueError) as err:  # a read-only cache: the run goes on, the next autotunes
            if self.speaks:
                print(f"kernel choices not recorded in {self.table}: {getattr(err, 'strerror', None) or err}",
                      flush=True)

    def close(self) -> None:
        if self._dumping:
            faulthandler.cancel_dump_traceback_later()
            self._dumping = False
        if self.report is not None:
            self.save()
            self.report.stop()
            self.report = None


def _gpu(device: torch.device) -> tuple[str, str]:
    major, minor = torch.cuda.get_device_capability(device)
    return torch.cuda.get_device_name(device), f"{major}.{minor}"
