"""`mimo plan --suggest --gpus N`: the layouts that fit memory (core/memory/layout_search.py), most estimated
tokens/s/GPU first (model.py), each with one line saying what its iteration is made of.

A provider without `model_flops` cannot be timed: its layouts keep layout_search's order (least communication,
then most headroom) and the advice says so in one line.

Layouts that differ in LLM data parallelism (CP and TP take lanes) differ in global batch where --global-batch-size
is not given: tokens/s/GPU compares them, each with its batch in samples and tokens (`Advised.tokens_per_sample`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mimo.plugins import LANGUAGE

from ..memory import fit, layout_search
from ..memory.layout_search import Suggestion
from . import calibration, workload
from .model import StepEstimate, estimate


@dataclass
class Advice:
    suggestion: Suggestion
    estimate: StepEstimate | None = None
    tokens_per_s_per_gpu: float | None = None
    why: str = ""  # one line: the iteration's time and what it is made of


@dataclass
class Advised:
    layouts: list[Advice]  # best first
    note: str | None = None  # why they are not ordered by time, or on what GPU the times are
    verdict: str = ""  # which to use and why, one line
    tokens_per_sample: float = 0.0  # the LLM's, as the estimate counts them: a row's batch in tokens


def memory_limit(config) -> tuple[float, str]:
    """(GiB, where it comes from) that --suggest fits layouts into: --gpu-memory, else the visible GPU, else the GPU
    the step times are estimated for (the calibration's), whatever --device says: the layouts are for GPUs."""
    given = fit.gpu_limit_gib(config, planning=True)
    if given is not None and given[1] != "default":
        return given
    cal = calibration.load()
    if cal.reference_gpu_gib is None:
        return fit.DEFAULT_GIB, "default"
    return cal.reference_gpu_gib, f"{cal.reference_gpu}, the GPU the times are estimated for"


def advise(plan, world: int, limit_gib: float, top: int = 10) -> Advised:
    """The `top` layouts of `world` GPUs that fit `limit_gib`, most estimated tokens/s/GPU first."""
    found = layout_search.fitting(plan, world, limit_gib)
    described = plan.hooks.module_memory(settings=plan.settings)
    language = described[LANGUAGE]
    tokens = language.mean_tokens_per_sample if language.mean_tokens_per_sample is not None \
        else language.tokens_per_sample  # as workload.modules_of counts them
    flops = workload.forward_flops(plan)
    if flops is None:
        note = (f"provider '{plan.config.provider}' reports no FLOPs per module (model_flops), so nothing is timed: "
                f"ordered by least communication, then most headroom")
        return Advised([Advice(s, why=s.reason) for s in layout_search.best_first(found)[:top]], note,
                       tokens_per_sample=tokens)
    cal = calibration.load()
    advised = []
    for s in found:
        modules = workload.modules_of(plan, flops, described, s.options.frozen)
        est = estimate(workload.step_inputs(modules, s.parallelism, s.options), cal)
        advised.append(Advice(s, est, est.tokens_per_s_per_gpu(modules[LANGUAGE].tokens_per_sample)))
    advised.sort(key=lambda a: (-a.tokens_per_s_per_gpu, -a.suggestion.headroom_gib))
    advised = advised[:top]
    for a in advised:
        a.why = "; ".join(filter(None, [why(a.estimate), a.suggestion.reason]))
    note = (f"times estimated for an {cal.reference_gpu} from measured efficiencies and overheads "
            f"(core/step_time/calibration.json), bf16")
    return Advised(advised, note, verdict(advised), tokens)


def _shares(terms: dict[str, float], total: float, count: int = 2) -> str:
    largest = sorted(terms.items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{name} {seconds / total:.0%}" for name, seconds in largest if seconds > 0)


def milliseconds(seconds: float) -> str:
    """A time in ms with the digits that tell layouts apart: 4,033; 24; 0.31."""
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 10 else f"{ms:.2g}"


def why(est: StepEstimate) -> str:
    """What the iteration is made of: the slower stage and its largest terms, the overlap's cost."""
    ms = milliseconds(est.seconds)
    after = {"DP gradient reduce": est.reduce_s, "optimizer": est.optimizer_s}
    if len(est.stages) == 1:
        return f"{ms} ms/iteration on every rank: {_shares({**est.stages[0].terms, **after}, est.seconds, 3)}"
    slowest = est.slowest
    others = [s for s in est.stages if s is not slowest]
    rest = "; ".join(f"{s.name} {s.ranks[0]}-{s.ranks[1]} at {s.busy / slowest.busy:.0%} of it" for s in others)
    return (f"{ms} ms/iteration: slower stage {slowest.name} {slowest.ranks[0]}-{slowest.ranks[1]} "
            f"{milliseconds(slowest.busy)} ms ({_shares(slowest.terms, slowest.busy)}); {rest}; fill, drain and "
            f"bridge {milliseconds(est.fill_drain_s + est.bridge_s)} ms; reduce and optimizer "
            f"{milliseconds(est.reduce_s + est.optimizer_s)} ms")


def verdict(advised: list[Advice]) -> str:
    """Which layout to use, and what the next one loses."""
    if not advised:
        return ""
    best = advised[0]
    line = f"use #1: the most tokens/s/GPU, {best.tokens_per_s_per_gpu:,.0f}"
    if len(advised) > 1:
        second = advised[1]
        slower = 1 - second.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu
        line += f"; #2 is {slower:.0%} slower ({_difference(best.estimate, second.estimate)})"
    return line


def _difference(best: StepEstimate, other: StepEstimate) -> str:
    """The term that grew most from `best` to `other`, per sample and GPU (their batches may differ)."""
    def per_sample(est: StepEstimate) -> dict[str, float]:
        terms = {"the split's pipeline": est.fill_drain_s + est.bridge_s, "DP gradient reduce": est.reduce_s,
                 "optimizer": est.optimizer_s}
        for stage in est.stages:
            for name, seconds in stage.terms.items():  # a stage's share of the iteration, by its busy time
                weight = 1.0 if len(est.stages) == 1 else (1.0 if stage is est.slowest else 0.0)
                terms[name] = terms.get(name, 0.0) + weight * seconds
        return {k: v * est.inputs.gpus / est.inputs.global_batch for k, v in terms.items()}

    a, b = per_sample(best), per_sample(other)
    grown = max(b, key=lambda k: b[k] - a.get(k, 0.0))
    return f"more {grown}"
