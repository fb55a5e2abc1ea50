"""The fused squared-ReLU-times-probabilities kernels (mimo.plugins.kit.squared_relu_probs) against the eager
expression on a GPU, at the Nemotron slice's expert shape: values and gradients (largest differences, relative to
the largest value) and milliseconds forward + backward (min-median-max of 20 after 5 warm-up runs).

    python3 scripts/gpu/check_squared_relu_probs.py [--rows 49152] [--cols 1856]
"""

from __future__ import annotations

import argparse
import json

import torch
from event_timing import spread_ms

from mimo.plugins.kit.squared_relu_probs import eager, squared_relu_probs


def run(fn, up, probs, grad):
    up, probs = up.detach().requires_grad_(), probs.detach().requires_grad_()
    out = fn(up, probs)
    out.backward(grad)
    return out, up.grad, probs.grad


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8192 * 6)  # tokens x top-k of one slice micro-batch
    parser.add_argument("--cols", type=int, default=1856)  # the released model's expert FFN width
    args = parser.parse_args()
    torch.manual_seed(0)
    up = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(args.rows, device="cuda", dtype=torch.float32)
    grad = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    fused, reference = run(squared_relu_probs, up, probs, grad), run(eager, up, probs, grad)
    report = {"shape": [args.rows, args.cols], "gpu": torch.cuda.get_device_name()}
    for name, a, b in zip(("out", "grad_up", "grad_probs"), fused, reference):
        a, b = a.float(), b.float()
        report[f"{name}_max_diff_relative"] = ((a - b).abs().max() / b.abs().max()).item()
    for name, fn in (("fused", squared_relu_probs), ("eager", eager)):
        report[f"{name}_ms"] = spread_ms(lambda: run(fn, up, probs, grad))
    print(json.dumps(report))
    worst = max(v for k, v in report.items() if k.endswith("relative"))
    raise SystemExit(0 if worst < 2e-2 else f"fused and eager differ by {worst:.3g} (relative)")


if __name__ == "__main__":
    main()
