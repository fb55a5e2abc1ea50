"""RADIO's packed (THD) self-attention on a GPU at the Nemotron slice's shapes: transformer-engine's fused
attention (cuDNN, what megatron-core's TE ViT layer calls), the same over heads zero-padded from 80 to 96 and 128
(cuDNN's packed backward takes a slow generic preprocessing kernel at RADIO's head dimension), and torch's
variable-length flash attention (the aten op itself: newer torch releases route `varlen_attn` to cuDNN on Hopper),
each given the query/key/value views megatron-core splits from one fused QKV GEMM output. Per draw of image sizes:
milliseconds forward without autograd (the graphed recomputed forward) and forward + backward (min-median-max of
20 after 5 warm-up runs), the kernels of one forward + backward, and each path's largest differences from the
first (output and gradients, relative to the largest value), te and flash also against fp32.

    python3 scripts/gpu/check_radio_attention.py [--draws 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

import torch
from event_timing import spread_ms
from transformer_engine.pytorch import DotProductAttention

HEADS, HEAD_DIM, CLASS_TOKENS, MIN_PATCHES, MAX_PATCHES, IMAGES = 16, 80, 8, 256, 4096, 8
SEQLEN_STEP = 256  # mimo rounds RADIO's max_seqlen up to this (providers/nemotron/model.py)


def lengths_of(draw: int) -> list[int]:
    """8 images' tokens: patch counts log-uniform in [256, 4096] (the slice's synthetic data), plus class tokens."""
    g = torch.Generator().manual_seed(1234 + draw)
    logs = torch.rand(IMAGES, generator=g) * (math.log(MAX_PATCHES) - math.log(MIN_PATCHES)) + math.log(MIN_PATCHES)
    return [int(math.exp(x)) + CLASS_TOKENS for x in logs.tolist()]


def qkv_views(tokens: int):
    """A fused QKV output [t, heads, 3 * d] split as megatron-core splits it (strided views, no copies)."""
    mixed = (torch.randn(tokens, HEADS, 3 * HEAD_DIM, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
    q, k, v = torch.split(mixed, [HEAD_DIM] * 3, dim=-1)
    return mixed, q, k, v


def te_attention(width: int = HEAD_DIM):
    """transformer-engine's attention; with `width` > 80 over heads zero-padded to it (the scale kept at
    1/sqrt(80)): the same scores and, in the first 80 columns, the same output."""
    dpa = DotProductAttention(HEADS, width, attention_dropout=0.0, qkv_format="thd", attn_mask_type="padding",
                              softmax_scale=1 / math.sqrt(HEAD_DIM))

    def attend(q, k, v, cu, m):
        if width != HEAD_DIM:
            q, k, v = (torch.nn.functional.pad(t, (0, width - HEAD_DIM)) for t in (q, k, v))
        out = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m, qkv_format="thd",
                  attn_mask_type="padding").view(q.shape[0], HEADS, width)
        return out[..., :HEAD_DIM].reshape(q.shape[0], -1)

    return attend


def varlen(q, k, v, cu, m):
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, m, m, 0.0, False, False,
                                                  scale=1 / math.sqrt(HEAD_DIM))[0]
    return out.reshape(q.shape[0], -1)


def reference(q, k, v, lengths) -> torch.Tensor:
    """fp32 attention per image."""
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start:start + n].float().transpose(0, 1) for t in (q, k, v))
        out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1).flatten(1))
        start += n
    return torch.cat(out)


def run(fn, lengths, cu, m, grad):
    torch.manual_seed(0)
    mixed, q, k, v = qkv_views(sum(lengths))
    out = fn(q, k, v, cu, m)
    out.backward(grad)
    return out.detach().float(), mixed.grad.float()


def kernels(body) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    body()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        body()
        torch.cuda.synchronize()
    by_name = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_name[event.name[:90]] += event.device_time_total / 1000
    return {k: round(v, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:8]}


def measure(name, fn, lengths, cu, m, grad) -> dict:
    mixed, q, k, v = qkv_views(sum(lengths))

    def forward():
        with torch.no_grad():
            fn(q, k, v, cu, m)

    def forward_backward():
        mixed.grad = None
        fn(q, k, v, cu, m).backward(grad)

    return {"path": name, "max_seqlen": m, "forward_ms": spread_ms(forward),
            "forward_backward_ms": spread_ms(forward_backward),
            "kernels_forward_backward_ms": kernels(forward_backward)}


def relative(a, b) -> float:
    return round(((a - b).abs().max() / b.abs().max()).item(), 5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": HEADS, "head_dim": HEAD_DIM,
              "draws": []}
    te_fn, padded = te_attention(), {w: te_attention(w) for w in (96, 128)}
    for draw in range(args.draws):
        lengths = lengths_of(draw)
        tokens = sum(lengths)
        cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()
        bound = -(-max(lengths) // SEQLEN_STEP) * SEQLEN_STEP
        grad = torch.randn(tokens, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        flops = 4 * sum(n * n for n in lengths) * HEADS * HEAD_DIM  # forward: QK^T and PV
        entry = {"lengths": lengths, "tokens": tokens, "forward_gflop": round(flops / 1e9, 2), "runs": [
            measure("te", te_fn, lengths, cu, bound, grad),
            measure("te-pad96", padded[96], lengths, cu, bound, grad),
            measure("te-pad128", padded[128], lengths, cu, bound, grad),
            measure("flash", varlen, lengths, cu, bound, grad),
        ]}
        for r in entry["runs"]:
            fwd, both = r["forward_ms"][1], r["forward_backward_ms"][1]
            r["tflops_forward"] = round(flops / fwd / 1e9, 1)
            r["tflops_forward_backward"] = round(3.5 * flops / both / 1e9, 1)  # backward 2.5 forwards
        te_out, te_grad = run(te_fn, lengths, cu, bound, grad)
        fl_out, fl_grad = run(varlen, lengths, cu, bound, grad)
        for w, fn in padded.items():
            p_out, p_grad = run(fn, lengths, cu, bound, grad)
            entry[f"te_vs_pad{w}"] = {"out": relative(p_out, te_out), "grad": relative(p_grad, te_grad)}
        torch.manual_seed(0)
        mixed, q, k, v = qkv_views(tokens)
        ref = reference(q, k, v, lengths)
        ref.backward(grad.float())
        entry["te_vs_flash"] = {"out": relative(fl_out, te_out), "grad": relative(fl_grad, te_grad)}
        entry["against_fp32"] = {"te_out": relative(te_out, ref.detach()), "flash_out": relative(fl_out, ref.detach()),
                                 "te_grad": relative(te_grad, mixed.grad.float()),
                                 "flash_grad": relative(fl_grad, mixed.grad.float())}
        report["draws"].append(entry)
        print(json.dumps(entry), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    worst = max(e[c][k] for e in report["draws"] for c in ("te_vs_flash", "te_vs_pad96", "te_vs_pad128")
                for k in ("out", "grad"))
    raise SystemExit(0 if worst < 2e-2 else f"the paths differ by {worst:.3g} (relative)")


if __name__ == "__main__":
    main()
