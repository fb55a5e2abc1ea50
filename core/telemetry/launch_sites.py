"""Where a profile's busiest kernels come from: for each, the places in the code that launched it.

torch.profiler ties every GPU kernel to the operator that launched it (on the CPU, an operator is its own
"kernel"). The place is that operator's nearest ancestor that says something: a Python frame outside torch (with
`--profile-with-stack`, the source line, e.g. megatron-core's bias-dropout-add), else the autograd node whose
backward ran it (`AddBackward0`), else the operator alone; the loop phase (`mimo/...`) follows it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch

import mimo

SITES_PER_KERNEL = 3
_FRAME = re.compile(r"^(?P<path>.+?)\((?P<line>\d+)\): (?P<function>.+)$")
_BACKWARD = "autograd::engine::evaluate_function: "
_LIBRARY_FRAMES = ("torch/", "<built-in", "threading.py", "contextlib.py", "functools.py")
_PASS_THROUGH = ("__torch_function__", "__torch_dispatch__")  # a tensor mode's frame (the CPU's device redirect)
_MIMO = str(Path(mimo.__file__).resolve().parent) + "/"


def site_of(event) -> str:
    """The place an operator event was launched from (see the module docstring)."""
    place, phase = None, None
    parent = event.cpu_parent
    while parent is not None:
        name = parent.name
        if place is None:
            frame = _FRAME.match(name)
            if frame and not frame["path"].startswith(_LIBRARY_FRAMES) and frame["function"] not in _PASS_THROUGH:
                place = f"{_short(frame['path'])}:{frame['line']} {frame['function']}"
            elif name.startswith(_BACKWARD):
                place = f"backward of {name[len(_BACKWARD):]}"
        if name.startswith("mimo/"):
            phase = name
            break
        parent = parent.cpu_parent
    site = f"{place} ({event.name})" if place else event.name
    return f"{site} in {phase}" if phase else site


def _short(path: str) -> str:
    """A frame's path from its package on (megatron/..., transformer_engine/..., mimo/...)."""
    if path.startswith(_MIMO):
        return "mimo/" + path[len(_MIMO):]
    for package in ("megatron/", "transformer_engine/", "mamba_ssm/", "site-packages/"):
        if package in path:
            return path[path.index(package):].removeprefix("site-packages/")
    return path


def launch_sites(events, *, on_gpu: bool, iterations: int, kernels: list[str]) -> dict[str, list[dict]]:
    """For each kernel name in `kernels`: its SITES_PER_KERNEL busiest launch sites, milliseconds per iteration."""
    wanted = set(kernels)
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        launched = ([(k.name, k.duration) for k in event.kernels] if on_gpu
                    else [(event.name, event.self_cpu_time_total)])
        launched = [(name, us) for name, us in launched if name in wanted and us > 0]
        if launched:
            site = site_of(event)
            for name, us in launched:
                totals[name][site] += us / 1000 / iterations
    return {name: [{"ms_per_iteration": ms, "site": site[:200]}
                   for site, ms in sorted(by_site.items(), key=lambda kv: -kv[1])[:SITES_PER_KERNEL]]
            for name, by_site in totals.items()}
