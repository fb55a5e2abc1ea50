"""The experts' weight gradients into fp32 main_grads (mimo.plugins.kit.grouped_wgrad) on a GPU, at the Nemotron
slice's expert shapes (16 experts, 8192 tokens x top 6, hidden 2688, FFN 1856; fc1 and fc2): the fused grouped
GEMM in several tile configurations, and torch's grouped GEMM followed by the Triton add (`separate`) or by
PyTorch's mixed-dtype add (`torch`, what ran before). Each against an fp32 reference (largest difference relative
to the largest value); milliseconds min-median-max of 20 after 5 warm-up runs; a configuration's first call
(compile) in seconds.

    python3 scripts/gpu/check_grouped_wgrad.py
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F
from event_timing import spread_ms

from mimo.plugins.kit import grouped_wgrad as gw

CONFIGS = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4)]


def case(n: int, k: int, experts: int = 16, rows: int = 8192 * 6) -> dict:
    torch.manual_seed(0)
    counts = torch.multinomial(torch.ones(experts), rows, replacement=True).bincount(minlength=experts)
    ends = counts.cumsum(0).to(device="cuda", dtype=torch.int32)
    dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    buffer = torch.zeros(experts * n * k, device="cuda")
    grads = [buffer[(experts - 1 - e) * n * k:(experts - e) * n * k].view(n, k) for e in range(experts)]
    reference = torch.stack([dy[s:e].float().t() @ x[s:e].float() for s, e in
                             zip([0] + ends[:-1].tolist(), ends.tolist())])
    scale = reference.abs().max().item()

    def error() -> float:
        return max((g - r).abs().max().item() for g, r in zip(grads, reference)) / scale

    report = {"n": n, "k": k, "counts": [min(counts.tolist()), max(counts.tolist())]}
    located = gw._buffer_offsets(grads)
    for config in CONFIGS:
        buffer.zero_()
        began = time.perf_counter()
        gw.launch_grouped_wgrad(*located, dy, x, ends, config=config)
        torch.cuda.synchronize()
        first = time.perf_counter() - began
        name = "fused_" + "x".join(map(str, config))
        report[name] = {"error": error(), "first_s": round(first, 2)}
        report[name]["ms"] = spread_ms(lambda: gw.launch_grouped_wgrad(*located, dy, x, ends, config=config))
    for name, add in (("separate", lambda g: gw.add_stacked(grads, g)),
                      ("torch", lambda g: torch._foreach_add_(grads, list(g.unbind(0))))):
        buffer.zero_()
        add(F.grouped_mm(dy.t(), x, offs=ends))
        report[name] = {"error": error(), "ms": spread_ms(lambda: add(F.grouped_mm(dy.t(), x, offs=ends)))}
    report["gemm_only_ms"] = spread_ms(lambda: F.grouped_mm(dy.t(), x, offs=ends))
    return report


def main() -> None:
    results = {"gpu": torch.cuda.get_device_name(), "fc1": case(1856, 2688), "fc2": case(2688, 1856)}
    print(json.dumps(results))
    worst = max(v["error"] for c in ("fc1", "fc2") for v in results[c].values() if isinstance(v, dict))
    raise SystemExit(0 if worst < 1e-2 else f"a result differs from the fp32 reference by {worst:.3g}")


if __name__ == "__main__":
    main()
