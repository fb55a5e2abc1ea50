"""The fault battery: mimo runs (mock-vlm, CPU) hurt on purpose, each checked against what a user must see.

    python scripts/fault_battery.py OUT [--kills 10] [--seed 0] [--parts kills,corrupt,lock,worker,orphans]
                                        [--orphan-kills 8] [--hf-folder HF_DIR]

- kills: SIGKILL at random moments around saves (at a save's named stages, or a random delay after a save
  starts); each run is resumed with `--load DIR --save DIR` and its following losses must equal an uninterrupted
  reference run's exactly.
- corrupt: every file of a checkpoint truncated, then overwritten in its middle, in turn; each resume must stop with
  exit 2 and one line (no traceback), or load unchanged weights (a file part that holds no state).
- lock: a second run saving into a running run's --save directory is refused (exit 2, one line); the first then
  stops on SIGTERM, saves, and exits 1 with one line.
- worker: one worker of a 2-process run is SIGKILLed; every process of the run must be gone within the timeout.
- orphans: SIGKILL of the main process only (not its session) at a random moment, with sync saves, async saves,
  --data read by 2 loader workers, and `mimo ckpt import-hf` (with --hf-folder; at a named stage of its save, as
  a tiny model imports in under a second); no process of the run may be
  alive 10 s later, and a resume into the same --save (a rerun into the same import folder) must finish, saying
  what it removed, with no partial directory left.

Writes OUT/battery.json (every case) and OUT/battery.md (the table for docs/verification.md); exit 1 if any case
failed. Each run gets a session of its own, killed when checked, so the battery leaves no processes behind.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

BASE = ("run", "--provider", "mock-vlm", "--device", "cpu", "--log-interval", "1", "--set", "image_probability=0.5")
ITERS, INTERVAL = 8, 2
STAGES = ("before-shards", "after-shards", "before-tracker")  # MIMO_FAULT_KILL_AT stages in core/checkpoint/checkpointer.py
TRACKER = "latest_checkpointed_iteration.txt"


class Run:
    """One `mimo` command in a session of its own, its output in files under `where`."""

    def __init__(self, where: Path, *args: str, env: dict | None = None):
        where.mkdir(parents=True, exist_ok=True)
        self.out, self.err = where / "stdout", where / "stderr"
        # A mark every process of this run inherits, its workers too (torch starts them in sessions of their own).
        self.mark = f"{os.getpid()}-{time.monotonic_ns()}"
        environment = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "MIMO_BATTERY_RUN": self.mark, **(env or {})}
        environment.setdefault("OMP_NUM_THREADS", "1")
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "mimo.cli", *args], stdout=out, stderr=err,
                                         env=environment, cwd=where, start_new_session=True)
        self.started = time.perf_counter()

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill_session()

    def wait_for(self, text: str, timeout: float = 120) -> None:
        """Until stdout holds `text`; an error if the run ends or the time runs out first."""
        deadline = time.time() + timeout
        while text not in self.out.read_text():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"never saw {text!r}: {self.err.read_text()[-2000:]}")
            time.sleep(0.05)

    def signal(self, number: int) -> None:
        os.kill(self.proc.pid, number)

    def session_pids(self) -> list[int]:
        """Every live process of this run (the run, its workers, their helpers), wherever it was reparented."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and _env(int(entry.name)).get("MIMO_BATTERY_RUN") == self.mark:
                try:
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                except OSError:
                    continue
                if state != "Z":  # a zombie has ended; only its parent's wait is missing
                    pids.append(int(entry.name))
        return pids

    def kill_session(self) -> None:
        """Kill every process of the run: its session, and workers in sessions of their own."""
        for pid in [self.proc.pid] + self.session_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stderr_lines(self) -> list[str]:
        return self.err.read_text().strip().splitlines()


def mimo(where: Path, *args: str, env: dict | None = None, timeout: float = 300) -> tuple[int, Run]:
    run = Run(where, *BASE, *args, env=env)
    return run.wait(timeout), run


def losses(metrics: Path) -> dict[int, float]:
    if not metrics.exists():
        return {}
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, metrics.read_text().splitlines())}


def tracked(save: Path) -> int | None:
    tracker = save / TRACKER
    return int(tracker.read_text()) if tracker.exists() else None


def one_line_error(code: int, run: Run, expected: int = 2) -> str | None:
    """None when the run ended with `expected` and exactly one `error:` line and no traceback, else why not."""
    lines = run.stderr_lines()
    if code != expected:
        return f"exit {code}, not {expected}: {' | '.join(lines[-3:])}"
    if len(lines) != 1 or not lines[0].startswith("error: ") or "Traceback" in run.err.read_text():
        return f"{len(lines)} stderr lines: {' | '.join(lines[:3])}"
    return None


# ---- the parts ----

def reference(out: Path) -> dict:
    code, run = mimo(out / "reference", "--train-iters", str(ITERS), "--save", str(out / "reference" / "save"),
                     "--save-interval", str(INTERVAL), "--metrics-file", str(out / "reference" / "m.jsonl"))
    if code:
        raise RuntimeError(f"the reference run failed: {run.err.read_text()[-2000:]}")
    return losses(out / "reference" / "m.jsonl")


def kills(out: Path, ref: dict, count: int, rng: random.Random) -> list[dict]:
    cases = []
    for k in range(count):
        where, at = out / f"kill{k}", rng.randrange(INTERVAL, ITERS + 1, INTERVAL)
        save, metrics = where / "save", where / "m.jsonl"
        run_args = ("--train-iters", str(ITERS), "--save", str(save), "--load", str(save),
                    "--save-interval", str(INTERVAL))
        if k % 4 == 3:  # a random delay after the save's log line of the iteration before: anywhere in or near it
            moment = rng.uniform(0.0, 0.4)
            how = f"SIGKILL {moment:.2f} s after iteration {at}"
            run = Run(where / "killed", *BASE, *run_args)
            try:
                run.wait_for(f"iteration {at:>6}/")
                time.sleep(moment)
            finally:
                run.kill_session()
            code = run.proc.wait()
        else:
            stage = rng.choice(STAGES)
            how = f"SIGKILL at {stage} of iteration {at}"
            code, run = mimo(where / "killed", *run_args, env={"MIMO_FAULT_KILL_AT": f"{stage}@{at}"})
        left = resumes_from(save)
        resume_code, resumed = mimo(where / "resumed", *run_args, "--metrics-file", str(metrics))
        after = losses(metrics)
        expected = {i: v for i, v in ref.items() if i > (left or 0)}
        diff = max((abs(after[i] - v) for i, v in expected.items() if i in after), default=None)
        ok = resume_code == 0 and after == expected and tracked(save) == ITERS
        cases.append({"part": "kill", "case": how, "killed_exit": code, "resumes_from_after_kill": left,
                      "resumed_iterations": sorted(after), "max_loss_difference": diff, "ok": ok,
                      "problem": None if ok else resumed.err.read_text()[-500:] or f"losses {after} vs {expected}"})
        print(f"kill {k}: {how}: resumes from {left}, resumed {len(after)} iterations, max difference {diff}: "
              f"{'ok' if ok else 'FAILED'}", flush=True)
    return cases


def resumes_from(save: Path) -> int | None:
    """What a resume loads after a kill: the tracker's iteration, or a newer complete checkpoint of its run that
    the kill left uncommitted (its common.pt written, the tracker not moved: the resume moves the tracker up)."""
    from mimo.core.checkpoint.save_dir import survey

    return survey(save).resumes


def corrupt(out: Path, only: set[str] | None = None) -> list[dict]:
    source = out / "reference" / "save"
    checkpoint = f"iter_{ITERS:07d}"
    files = sorted(p.name for p in (source / checkpoint).iterdir() if not only or p.name in only)
    cases = []
    for name in files:
        for how in ("truncated", "overwritten"):
            where = out / "corrupt" / f"{name.strip('.')}-{how}"
            save = where / "save"
            shutil.rmtree(where, ignore_errors=True)
            shutil.copytree(source, save)
            path = save / checkpoint / name
            data = path.read_bytes()
            if how == "truncated":
                path.write_bytes(data[: len(data) // 2])
            else:  # same size: bytes in the middle replaced by a pattern no encoder writes
                middle = len(data) // 2
                path.write_bytes(data[:middle] + b"\xa5" * min(64, len(data) - middle) + data[middle + 64:])
            code, run = mimo(where, "--train-iters", str(ITERS + 1), "--load", str(save))
            problem = one_line_error(code, run)
            cases.append({"part": "corrupt", "case": f"{name} {how}", "exit": code,
                          "line": (run.stderr_lines() or [""])[0][:300], "ok": problem is None, "problem": problem})
            print(f"corrupt {name} {how}: exit {code}: {(run.stderr_lines() or [''])[0][:160]}", flush=True)
    return cases


def lock(out: Path) -> list[dict]:
    save = out / "lock" / "save"
    first = Run(out / "lock" / "first", *BASE, "--train-iters", "100000", "--save", str(save))
    try:
        first.wait_for("iteration      2/")
        code, second = mimo(out / "lock" / "second", "--train-iters", "2", "--save", str(save))
        refused = one_line_error(code, second)
        if refused is None and "in use by another run" not in second.stderr_lines()[0]:
            refused = f"not the lock's line: {second.stderr_lines()[0]}"
        first.signal(signal.SIGTERM)
        stopped = first.proc.wait(timeout=120)
    finally:
        first.kill_session()
    stop_problem = one_line_error(stopped, first, expected=1)
    return [{"part": "lock", "case": "a second run saving into the same --save", "exit": code,
             "line": (second.stderr_lines() or [""])[0], "ok": refused is None, "problem": refused},
            {"part": "lock", "case": "the first run stopped by SIGTERM", "exit": stopped,
             "line": (first.stderr_lines() or [""])[0], "saved": tracked(save),
             "ok": stop_problem is None and tracked(save) is not None, "problem": stop_problem}]


def worker(out: Path, timeout: float = 60) -> list[dict]:
    run = Run(out / "worker", *BASE, "--train-iters", "100000", "--nproc-per-node", "2")
    try:
        run.wait_for("iteration      2/")
        victim = next(pid for pid in run.session_pids() if _name(pid) == "mimo rank 1")
        os.kill(victim, signal.SIGKILL)
        killed = time.perf_counter()
        while (run.proc.poll() is None or run.session_pids()) and time.perf_counter() - killed < timeout:
            time.sleep(0.05)
        gone_after = time.perf_counter() - killed
        left = run.session_pids()
        code = run.proc.poll()
    finally:
        run.kill_session()
    ok = not left and code == 1
    print(f"worker: rank 1 SIGKILLed; all processes gone after {gone_after:.2f} s, exit {code}", flush=True)
    return [{"part": "worker", "case": "rank 1 of 2 SIGKILLed", "exit": code, "seconds_until_all_gone": gone_after,
             "left": left, "line": (run.stderr_lines() or [""])[-1], "ok": ok,
             "problem": None if ok else f"exit {code}, {len(left)} processes left"}]


ORPHAN_KINDS = ("sync", "async", "data", "import")
ORPHAN_LIMIT_S = 10.0


def _gone_after(run: Run, limit: float) -> tuple[float, list[int]]:
    """Seconds until no process of the run is left (at most `limit`), and those left then."""
    killed = time.perf_counter()
    while run.session_pids() and time.perf_counter() - killed < limit:
        time.sleep(0.1)
    return time.perf_counter() - killed, run.session_pids()


def _partials(save: Path) -> list[str]:
    return sorted(p.name for p in save.glob("iter_*") if not (p / "common.pt").is_file())


def orphans(out: Path, count: int, rng: random.Random, hf_folder: Path | None, kinds=ORPHAN_KINDS) -> list[dict]:
    kinds = [k for k in kinds if k != "import" or hf_folder is not None]
    data = out / "orphans" / "data"
    if "data" in kinds and not data.exists():
        Run(out / "orphans" / "make-data", "data", "sample", str(data), "--num-samples", "48").wait()
    cases = []
    for k in range(count):
        kind = kinds[k % len(kinds)]
        where = out / "orphans" / f"{kind}{k}"
        save = where / "save"
        if kind == "import":
            # a tiny model imports in well under a second once started: SIGKILL at a named stage of its save
            # (MIMO_FAULT_KILL_AT, as the kills part does), in the middle of writing OUT
            stage = rng.choice(STAGES)
            run = Run(where / "killed", "ckpt", "import-hf", str(hf_folder), str(save),
                      env={"MIMO_FAULT_KILL_AT": f"{stage}@0"})
            run.proc.wait(timeout=300)
            how = f"SIGKILL of import-hf at {stage} of its save"
        else:
            extra = {"sync": (), "async": ("--async-save",),
                     "data": ("--async-save", "--data", str(data), "--num-workers", "2")}[kind]
            at, moment = rng.randrange(2, 6), rng.uniform(0.0, 0.6)
            run = Run(where / "killed", *BASE, "--train-iters", "100000", "--save", str(save), "--save-interval",
                      "2", *extra)
            run.wait_for(f"iteration {at:>6}/", timeout=300)
            time.sleep(moment)
            how = f"SIGKILL of the main process ({kind}) {moment:.2f} s after iteration {at}"
        done_before = run.proc.poll() is not None  # an import killed at its fault point has ended already
        try:
            if not done_before:
                os.kill(run.proc.pid, signal.SIGKILL)  # the main process only: its children must follow by themselves
            run.proc.wait()
            seconds, left = _gone_after(run, ORPHAN_LIMIT_S)
        finally:
            run.kill_session()
        partial_before = _partials(save) if kind != "import" else sorted(
            p.name for p in save.parent.glob(f".{save.name}.mimo-partial-*"))
        if kind == "import":
            complete = (save / TRACKER).is_file()  # killed after it finished: a rerun must refuse the folder
            code, again = mimo_command(where / "again", "ckpt", "import-hf", str(hf_folder), str(save))
            finished = (not complete and code == 0 and (save / TRACKER).is_file()) or (
                complete and code == 2 and "is not empty" in again.err.read_text())
            how += " (it had finished)" if complete else ""
            leftover = sorted(p.name for p in save.parent.glob(f".{save.name}.mimo-partial-*"))
        else:
            resume_to = (tracked(save) or 0) + 2
            code, again = mimo(where / "again", "--train-iters", str(resume_to), "--save", str(save), "--load",
                               str(save), "--save-interval", "2", *extra)
            finished = code == 0 and tracked(save) == resume_to
            leftover = _partials(save)
        said = [line for line in again.out.read_text().splitlines() if line.startswith("removed ")]
        ok = not left and finished and not leftover and (bool(said) or not partial_before)
        cases.append({"part": "orphans", "case": how, "seconds_until_all_gone": seconds, "left": left,
                      "partial_after_kill": partial_before, "removal_line": said[0] if said else None,
                      "rerun_exit": code, "ok": ok,
                      "problem": None if ok else f"{len(left)} left, rerun exit {code}, leftover {leftover}: "
                                                 f"{again.err.read_text()[-300:]}"})
        print(f"orphans {k}: {how}: gone after {seconds:.2f} s ({len(left)} left), partial {partial_before}, "
              f"rerun exit {code}: {'ok' if ok else 'FAILED'}", flush=True)
    return cases


def mimo_command(where: Path, *args: str) -> tuple[int, Run]:
    run = Run(where, *args)
    return run.wait(), run


def _name(pid: int) -> str:
    """The process's name: mimo's workers name their rank ("mimo rank 1")."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _env(pid: int) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def table(cases: list[dict], seconds: float) -> str:
    rows = ["| part | case | outcome | ok |", "| --- | --- | --- | --- |"]
    for c in cases:
        if c["part"] == "kill":
            outcome = (f"resumes from {c['resumes_from_after_kill']} after the kill; resumed iterations "
                       f"{c['resumed_iterations'][0] if c['resumed_iterations'] else '-'}-{ITERS}, largest loss "
                       f"difference {c['max_loss_difference']}")
        elif c["part"] == "worker":
            outcome = f"exit {c['exit']}, every process gone after {c['seconds_until_all_gone']:.2f} s"
        elif c["part"] == "orphans":
            outcome = (f"every process gone after {c['seconds_until_all_gone']:.2f} s; partial after the kill: "
                       f"{', '.join(c['partial_after_kill']) or 'none'}; rerun exit {c['rerun_exit']}")
        else:
            outcome = f"exit {c['exit']}: `{c['line']}`"
        rows.append(f"| {c['part']} | {c['case']} | {outcome} | {'yes' if c['ok'] else 'NO'} |")
    passed = sum(c["ok"] for c in cases)
    return "\n".join(rows) + f"\n\n{passed} of {len(cases)} cases as expected, in {seconds:.0f} s.\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", default="kills,corrupt,lock,worker")
    parser.add_argument("--corrupt-files", default="", help="comma-separated checkpoint file names (default: all)")
    parser.add_argument("--orphan-kills", type=int, default=8)
    parser.add_argument("--orphan-kinds", default=",".join(ORPHAN_KINDS))
    parser.add_argument("--hf-folder", type=Path, default=None,
                        help="a Hugging Face folder a provider imports (for the import-hf kills of the orphans part)")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # each run works in a folder of its own
    parts, started, cases = set(args.parts.split(",")), time.perf_counter(), []
    args.out.mkdir(parents=True, exist_ok=True)
    if parts & {"kills", "corrupt"}:
        ref = reference(args.out)
        if "kills" in parts:
            cases += kills(args.out, ref, args.kills, random.Random(args.seed))
        if "corrupt" in parts:
            cases += corrupt(args.out, set(filter(None, args.corrupt_files.split(","))) or None)
    if "lock" in parts:
        cases += lock(args.out)
    if "worker" in parts:
        cases += worker(args.out)
    if "orphans" in parts:
        cases += orphans(args.out, args.orphan_kills, random.Random(args.seed), args.hf_folder,
                         tuple(args.orphan_kinds.split(",")))
    seconds = time.perf_counter() - started
    (args.out / "battery.json").write_text(json.dumps({"seconds": seconds, "cases": cases}, indent=1))
    (args.out / "battery.md").write_text(table(cases, seconds))
    print(table(cases, seconds))
    return 0 if all(c["ok"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
