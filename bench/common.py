"""What the benchmarks share: running `mimo run` in a fresh interpreter and reading its metrics file, steady-state
figures, and writing results (a printed table, JSON with the device and commands, and a PNG plot).

Every script takes `--out DIR` (results) and `--quick` (tiny settings for a CPU smoke run of the script itself;
its figures mean nothing).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

OOM = re.compile(r"out of memory|OutOfMemoryError", re.I)
STEADY_KEYS = ("elapsed_ms", "tokens_per_sec_per_gpu", "tflops_per_gpu", "mfu", "peak_memory_gib")
# what a record's tokens and FLOPs counted (docs/telemetry.md): the rows (synthetic data) or the --data samples'
COUNTED_KEYS = ("tokens_counted", "flops_counted")


@dataclass
class Run:
    """One `mimo run`: its command, exit status, logged records and output."""

    command: list[str]
    returncode: int
    records: list[dict]
    output: str
    seconds: float
    log: Path
    timeout: float | None = None  # the limit it was stopped at, if it was
    to_first_iteration_s: float | None = None  # from the start of the process to iteration 1's log line

    @property
    def status(self) -> str:
        if self.returncode == 0:
            return "ok"
        if self.timeout is not None:
            return f"timeout after {self.timeout:.0f} s"
        return "out of memory" if OOM.search(self.output) else f"failed (exit {self.returncode}, see {self.log})"

    def printed(self) -> str:
        return "mimo " + shlex.join(self.command)


def mimo_run(args: list[str], out: Path, name: str, timeout: float = 1800, env: dict | None = None) -> Run:
    """`mimo run ARGS --metrics-file out/name.jsonl`, output teed to out/name.log; a failure is a result. Past
    `timeout` seconds the run's whole process group is killed (a run inside its first iteration ignores SIGTERM
    until the iteration ends). `env`: variables to set for the run."""
    out.mkdir(parents=True, exist_ok=True)
    metrics, log = out / f"{name}.jsonl", out / f"{name}.log"
    metrics.unlink(missing_ok=True)
    command = ["run", *args, "--metrics-file", str(metrics)]
    print(f"== {name}: mimo {shlex.join(command)}", flush=True)
    started = time.perf_counter()
    lines, first, stopped = [], None, None
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "mimo.cli", *command], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
                                start_new_session=True)
        fired = []
        timer = threading.Timer(timeout, lambda: (fired.append(True), _kill_group(proc)))
        timer.start()
        try:
            for line in proc.stdout:
                sink.write(line)
                lines.append(line)
                if first is None and line.startswith("iteration "):
                    first = time.perf_counter() - started
                if _worth_echoing(line):
                    print("   " + line.rstrip()[:240], flush=True)
            returncode = proc.wait()
        finally:
            timer.cancel()
            _kill_group(proc)  # anything the run left behind
        stopped = timeout if fired else None
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    return Run(command, returncode, records, "".join(lines), time.perf_counter() - started, log, stopped, first)


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _worth_echoing(line: str) -> bool:
    return line.startswith(("iteration", "mimo run:", "saved checkpoint", "loaded checkpoint", "FLOP check",
                            "profile", "  ", "error", "first iteration")) or bool(OOM.search(line))


def steady(records: list[dict], warmup_records: int = 1) -> dict:
    """Means over the logged intervals after the first `warmup_records` (compilation, allocator, caches), and what
    their tokens and FLOPs counted."""
    kept = records[warmup_records:] or records[-1:]
    result = {}
    for key in STEADY_KEYS:
        values = [r[key] for r in kept if r.get(key) is not None]
        if values:
            result[key] = max(values) if key == "peak_memory_gib" else sum(values) / len(values)
    result.update({key: kept[-1][key] for key in COUNTED_KEYS if kept and key in kept[-1]})
    return result


def spread(records: list[dict], key: str) -> dict | None:
    """min, median and max of `key` over `records` (the steady iterations), and how many there were."""
    values = sorted(r[key] for r in records if r.get(key) is not None)
    if not values:
        return None
    return {"min": values[0], "median": statistics.median(values), "max": values[-1], "n": len(values)}


def device_description() -> dict:
    import torch

    info = {"torch": torch.__version__, "python": platform.python_version(), "host_cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    else:
        info["gpu"] = None
    try:
        from importlib.metadata import version

        info["megatron_core"] = version("megatron-core")
    except Exception:  # noqa: BLE001 - informational only
        pass
    return info


@dataclass
class Results:
    """A benchmark's rows plus what makes them reproducible; `write` prints and saves them."""

    name: str
    columns: list[tuple[str, str, str]]  # (row key, header, format)
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def write(self, out: Path, extra: dict | None = None, show: bool = True) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        document = {
            "benchmark": self.name,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device_description(),
            "rows": self.rows,
            "notes": self.notes,
            **(extra or {}),
        }
        path = out / f"{self.name}.json"
        path.write_text(json.dumps(document, indent=1))
        if show:
            self.print_table()
            print(f"results: {path}")
        return path

    def print_table(self) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=self.name)
        for _, header, _ in self.columns:
            table.add_column(header, justify="right")
        for row in self.rows:
            table.add_row(*[format_cell(row.get(key), spec) for key, _, spec in self.columns])
        console = Console(width=200)
        console.print(table)
        for note in self.notes:
            console.print(note)


def format_cell(value, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and spec:
        return format(value, spec)
    return str(value)


def bar_plot(path: Path, labels: list[str], series: dict[str, list[float | None]], ylabel: str, title: str) -> None:
    """Grouped bars, one group per label; skipped with a note when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot {path.name}: matplotlib is not installed (pip install 'mimo[bench]'); the JSON has the figures")
        return
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels) + 2), 4))
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        bars = ax.bar(xs, [v or 0 for v in values], width, label=name)
        ax.bar_label(bars, labels=["" if v is None else f"{v:.3g}" for v in values], fontsize=8)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def profile_notes(rows: list[dict]) -> list[str]:
    """One line per profiled row: the GPU's busy time per iteration against wall time, by kind of kernel."""
    notes = []
    for row in rows:
        profile = row.get("profile")
        if profile and profile.get("idle_fraction") is not None:
            kinds = ", ".join(f"{kind} {ms:.0f} ms" for kind, ms in profile["ms_per_iteration_by_kind"].items())
            notes.append(f"{row['case']}: GPU busy {profile['busy_ms_per_iteration']:.0f} of "
                         f"{profile['wall_ms_per_iteration']:.0f} ms per iteration ({kinds})")
    return notes


def settings_args(settings: dict) -> list[str]:
    """Provider settings as `--set key=value` options."""
    return [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]


def plan_json(options: list[str]) -> tuple[dict | None, str]:
    """`mimo plan OPTIONS --json` as a dict with `largest` (its largest rank: total, allocated, ...) added, or
    (None, the plan's last line of output) where it refused or failed."""
    out = subprocess.run([sys.executable, "-m", "mimo.cli", "plan", *options, "--json"], capture_output=True,
                         text=True)
    try:
        plan = json.loads(out.stdout)
        plan["largest"] = max(plan["memory"]["ranks"], key=lambda rank: rank["total"])
        return plan, ""
    except (ValueError, KeyError, TypeError):
        return None, ((out.stderr or out.stdout).strip().splitlines() or [""])[-1]
