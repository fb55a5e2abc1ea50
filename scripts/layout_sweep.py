"""The layout sweep: every layout of up to 4 CPU processes `mimo plan` is asked about, and each one it accepts run.

    python scripts/layout_sweep.py OUT [--minutes 60] [--providers mock-vlm nemotron-moe-vlm-tiny] [--iterations 2]
                                       [--only TEXT ...]

For each provider: colocated and heterogeneous layouts (`--encoder-ranks`), encoder TP (colocated too: at the LLM's
TP or their own), LLM TP (with `--sequence-parallel` where the provider needs it), PP (colocated too: the LLM's stages
beside the encoders), EP and CP, at most two of the LLM's kinds at once, micro-batch 1 of a 12-sample global batch
(2 where colocated encoders encode shares of it), half the samples without an image. A layout passes when `mimo
plan` refuses it in one line (exit 2, no traceback), or when it accepts it and `mimo run` trains: exit 0 and, where
initial weights do not depend on the layout (no EP: each rank draws its own experts; no PP: each stage its own
layers; docs/parallelism.md), the single process's losses within 1e-6. A plan that accepts a layout `mimo run` then refuses fails too: the refusal
belongs before any process starts. One process goes first, then heterogeneous layouts. Writes OUT/sweep.json (every case) as it goes;
exit 1 if any case failed. About 25 minutes on 2 cores for both providers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

COMMON = ("--device", "cpu", "--micro-batch-size", "1", "--global-batch-size", "12", "--set", "image_probability=0.5")
MOE = {"nemotron-moe-vlm-tiny"}  # providers whose LLM has experts (EP applies, TP needs sequence parallelism)


def layouts(provider: str) -> list[tuple[str, ...]]:
    found = [()]
    for world in (2, 3, 4):
        for encoder_ranks in range(world):
            llm_ranks = world - encoder_ranks if encoder_ranks else world
            for etp, tp, pp, ep, cp in itertools.product((1, 2), repeat=5):
                if etp > 1 and (encoder_ranks or world) % etp:
                    continue
                if llm_ranks % (tp * pp * cp) or (ep > 1 and provider not in MOE):
                    continue
                if sum(n > 1 for n in (tp, pp, ep, cp)) > 2:
                    continue
                args = ["--nproc-per-node", str(world)]
                args += ["--encoder-ranks", str(encoder_ranks)] if encoder_ranks else []
                args += ["--encoder-tp", str(etp)] if etp > 1 else []
                for flag, n in (("--llm-tp", tp), ("--llm-pp", pp), ("--llm-ep", ep), ("--llm-cp", cp)):
                    args += [flag, str(n)] if n > 1 else []
                args += ["--sequence-parallel"] if tp > 1 and provider in MOE else []
                if not encoder_ranks and (etp != tp or pp > 1):
                    # colocated encoders at their own TP, or beside the LLM's stages: each of their ranks encodes a
                    # share of a lane's micro-batch, so two samples make one
                    args += ["--micro-batch-size", "2"]
                found.append(tuple(args))
    # one process first (the losses others are held to), then heterogeneous layouts, the most options first
    return sorted(found, key=lambda a: (bool(a), "--encoder-ranks" not in a, -len(a)))


def mimo(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1"}
    try:
        return subprocess.run([sys.executable, "-m", "mimo.cli", *args], capture_output=True, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, "timeout", "", "timed out")


def one_line_refusal(result: subprocess.CompletedProcess) -> bool:
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("error:")]
    return result.returncode == 2 and "Traceback" not in result.stderr and len(set(lines)) == 1


def losses(path: Path) -> list[float]:
    return [json.loads(line)["lm_loss"] for line in path.read_text().splitlines()] if path.exists() else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--providers", nargs="+", default=["nemotron-moe-vlm-tiny", "mock-vlm"])
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="run only the layouts whose options contain one of these (and one process)")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    deadline, cases, failed = time.monotonic() + options.minutes * 60, [], 0
    for provider in options.providers:
        reference = None
        for args in layouts(provider):
            if args and options.only and not any(text in " ".join(args) for text in options.only):
                continue
            if time.monotonic() > deadline:
                print(f"stopped at --minutes {options.minutes:g}: {len(cases)} cases done", flush=True)
                break
            case = {"provider": provider, "layout": " ".join(args) or "one process"}
            plan = mimo("plan", "--provider", provider, *COMMON, *args)
            if plan.returncode != 0:
                case.update(verdict="refused by plan" if one_line_refusal(plan) else "plan failed",
                            said=plan.stderr.strip().splitlines()[-1:])
            else:
                metrics = options.out / f"{provider}-{len(cases)}.jsonl"
                metrics.unlink(missing_ok=True)
                run = mimo("run", "--provider", provider, *COMMON, *args, "--train-iters", str(options.iterations),
                           "--log-interval", "1", "--seed", "3", "--metrics-file", str(metrics))
                got = losses(metrics)
                reference = got if not args else reference
                comparable = reference and not {"--llm-ep", "--llm-pp"} & set(args)
                difference = max((abs(a - b) / abs(b) for a, b in zip(got, reference)), default=None) if comparable \
                    else None
                if run.returncode == 0:
                    ok = difference is None or difference <= 1e-6
                    case.update(verdict="trained" if ok else "losses differ", losses=got, difference=difference)
                else:
                    case.update(verdict="refused by run after plan accepted" if one_line_refusal(run) else "crashed",
                                said=run.stderr.strip().splitlines()[-3:])
            failed += case["verdict"] not in ("trained", "refused by plan")
            cases.append(case)
            print(json.dumps(case), flush=True)
            (options.out / "sweep.json").write_text(json.dumps(cases, indent=1))
    print(f"{len(cases)} cases, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
