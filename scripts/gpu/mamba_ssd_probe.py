"""GPU probe (torch, mamba-ssm and triton only: after `bash scripts/gpu/slice.sh install`, PYTHONPATH=/tmp/te-site):
the Mamba-2 training kernel megatron-core's MambaMixer calls (mamba_split_conv1d_scan_combined, z-gated, no fused
norm/out-proj) at the Nemotron slice's and mid's shapes, chunk 128 (megatron's default) and 256.

Per shape and chunk: first fwd+bwd call (Triton compile + autotune: the share of mimo's first iteration that is
mamba-ssm's), the number of configs benchmarked, then fwd and fwd+bwd time (median of do_bench), and the autotune
choices (the pin table). Use its own TRITON_CACHE_DIR so later runs still start cold.

    TRITON_CACHE_DIR=/tmp/triton-probe python3 mamba_ssd_probe.py --out $OUT/mamba_probe.json
"""
import argparse
import json
import time

import torch
import triton
from mamba_ssm.ops.triton.ssd_combined import mamba_split_conv1d_scan_combined

SHAPES = {  # name: (batch, seqlen, nheads, headdim, ngroups, dstate, conv width)
    "slice": (1, 8192, 64, 64, 8, 128, 4),
    "mid": (4, 2048, 32, 64, 4, 128, 4),
}


def autotuners():
    import importlib
    from triton.runtime.autotuner import Autotuner
    out = {}
    for m in ("ssd_bmm", "ssd_chunk_scan", "ssd_chunk_state", "ssd_combined", "ssd_state_passing"):
        mod = importlib.import_module(f"mamba_ssm.ops.triton.{m}")
        out.update({f"{mod.__name__}.{k}": v for k, v in vars(mod).items() if isinstance(v, Autotuner)})
    return out


def inputs(b, l, h, p, g, n, w):
    dim = h * p
    dev, bf = "cuda", torch.bfloat16
    zxbcdt = (torch.randn(b, l, 2 * dim + 2 * g * n + h, device=dev, dtype=bf) * 0.5).requires_grad_()
    conv_w = (torch.randn(dim + 2 * g * n, w, device=dev, dtype=bf) * 0.3).requires_grad_()
    conv_b = torch.zeros(dim + 2 * g * n, device=dev, dtype=bf, requires_grad=True)
    dt_bias = torch.full((h,), -2.0, device=dev, requires_grad=True)
    A = -(torch.rand(h, device=dev) + 0.5)
    A.requires_grad_()
    D = torch.ones(h, device=dev, requires_grad=True)
    return zxbcdt, conv_w, conv_b, dt_bias, A, D, p, g


def run(args_, chunk):
    zxbcdt, conv_w, conv_b, dt_bias, A, D, p, g = args_
    return mamba_split_conv1d_scan_combined(zxbcdt, conv_w, conv_b, dt_bias, A, D, chunk_size=chunk,
                                            activation="silu", headdim=p, ngroups=g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--chunks", nargs="*", type=int, default=[128, 256])
    a = ap.parse_args()
    report = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__, "rows": []}
    for name in a.shapes:
        for chunk in a.chunks:
            args_ = inputs(*SHAPES[name])
            torch.cuda.synchronize(); t0 = time.perf_counter()
            y = run(args_, chunk); y.float().square().mean().backward()
            torch.cuda.synchronize(); first = time.perf_counter() - t0
            tuned = sum(1 for k, t in autotuners().items() if t.cache)
            g = torch.randn_like(y)
            fwd = triton.testing.do_bench(lambda: run(args_, chunk), warmup=25, rep=200, return_mode="median")
            fb = triton.testing.do_bench(lambda: run(args_, chunk).backward(g), warmup=25, rep=200,
                                         return_mode="median", grad_to_none=list(args_[:6]))
            row = {"shape": name, "chunk": chunk, "first_call_s": round(first, 2), "autotuners_with_choices": tuned,
                   "fwd_ms": round(fwd, 3), "fwd_bwd_ms": round(fb, 3)}
            print(row, flush=True)
            report["rows"].append(row)
    report["pins"] = {k: [{"key": list(key), "config": {"kwargs": c.kwargs, "num_warps": c.num_warps,
                                                         "num_stages": c.num_stages}}
                          for key, c in t.cache.items()] for k, t in autotuners().items() if t.cache}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
