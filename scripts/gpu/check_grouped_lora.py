"""LoRA on transformer-engine's grouped experts run as mimo's grouped GEMMs (`GroupedMMExperts`, the te backend's
experts) on a GPU, the tiny Nemotron with adapters on its routed experts, every layout:

* each MoE layer's experts with adapters against a per-expert loop in fp32 (weights weight0..N, each expert's
  A and B): outputs and adapter gradients, with the activation kept and recomputed (selective recompute);
* the adapters' checkpoint keys are those of the local backend's SequentialMLP experts;
* merging folds them into weight0..N: the merged model's logits are the adapted model's;
* (te backend) the experts forced onto transformer-engine's grouped linears, the forward FP8 keeps them on
  (core/adapters/te_grouped_linears.py), against the grouped-GEMM path: outputs, input and adapter gradients;
* (te backend, bf16) the model built with --fp8 tensorwise and delayed: each MoE layer's experts in megatron-core's
  FP8 context run forward and backward with finite values, and the adapters' contribution (the output minus the
  output with every B zeroed) is the bf16 grouped-GEMM path's within FP8's error; the whole model's forward and
  backward give finite logits and adapter gradients.

Prints one JSON line per check; exits 1 if any is off.

    NVIDIA_TF32_OVERRIDE=0 python3 scripts/gpu/check_grouped_lora.py [--precision bf16]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from mimo.core.adapters.apply import adapter_parameters, merge_adapters
from mimo.core.adapters.grouped_experts import FC, adapters_of
from mimo.core.config import AdapterOptions, PerformanceOptions, RunConfig, TrainingOptions
from mimo.core.forward.batch_transfer import to_device
from mimo.core.run.plan import prepare
from mimo.core.run.world import join

RANK, TOKENS = 4, 96
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: the script's own check


FP8_TOLERANCE = 0.25  # the adapters' contribution under FP8 against bf16's, relative in norm (not yet calibrated)


def build(backend: str, layout: str, precision: str, expert_gemm: str = "grouped_mm", fp8: str = "none"):
    # FP8 GEMMs need the Mamba input projection's width (2 x heads x head dim + 2 x groups x state + heads) a
    # multiple of 16: the tiny model's 4 heads give 196, 16 heads 592
    shape = ["mamba_num_heads=16"] if fp8 != "none" else []
    plan = prepare(RunConfig(provider="nemotron-moe-vlm-tiny",
                             provider_settings=[f"backend={backend}", f"expert_gemm={expert_gemm}", *shape],
                             training=TrainingOptions(device=DEVICE.type, micro_batch_size=2, precision=precision),
                             performance=PerformanceOptions(fp8=fp8),
                             adapters=AdapterOptions(lora_rank=RANK, lora_targets="language:experts",
                                                     lora_experts=layout)), world_size=1)
    run = join(plan)
    model = run.build_model()
    batch = next(iter(plan.hooks.data_provider(settings=plan.settings, ctx=run.data_context())))
    with torch.no_grad():  # B away from zero, as after training
        generator = torch.Generator(device=DEVICE).manual_seed(0)
        for name, param in adapter_parameters(model):
            if name.endswith(".b"):
                param.copy_(torch.randn(param.shape, generator=generator, device=DEVICE) * 0.05)
    return model, batch


def moe_experts(model) -> list:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m.experts for m in model.modules() if isinstance(m, MoELayer)]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def tokens(experts, multiple: int = 1) -> tuple:
    """Counts per local expert (the first none; each a multiple of `multiple`), tokens, probabilities and an
    upstream gradient, in the experts' dtype."""
    count, hidden_size, dtype = experts.num_local_experts, experts.config.hidden_size, experts.config.params_dtype
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    counts = torch.multinomial(torch.ones(count), TOKENS, replacement=True).bincount(minlength=count)
    counts = (counts + multiple - 1) // multiple * multiple
    counts[0] = 0  # an expert without tokens
    rows = int(counts.sum())
    hidden = torch.randn(rows, hidden_size, device=DEVICE, generator=generator).to(dtype).requires_grad_()
    probs = torch.rand(rows, device=DEVICE, generator=generator).to(dtype)
    upstream = torch.randn(rows, hidden_size, device=DEVICE, generator=generator).to(dtype)
    return counts, hidden, probs, upstream


def expert_loras(experts) -> tuple[dict, list]:
    """Each linear's adapter for every local expert, and the adapter parameters (each once)."""
    adapters = {fc: adapters_of(experts, fc) for fc in FC}
    loras = {fc: a if isinstance(a, list) else [a] * experts.num_local_experts for fc, a in adapters.items()}
    return loras, list(dict.fromkeys(p for fc in FC for lora in loras[fc] for p in (lora.a, lora.b)))


def run_experts(experts, counts, hidden, probs, upstream, params, zero_grads, fp8: bool = False) -> tuple:
    """One forward and backward of the experts (in megatron-core's FP8 context if `fp8`): output, input gradient,
    adapter gradients (DDP's main_grad)."""
    import contextlib

    from megatron.core.fp8_utils import get_fp8_context

    zero_grads()
    x = hidden.detach().clone().requires_grad_()
    with get_fp8_context(experts.config) if fp8 else contextlib.nullcontext():
        out, _ = experts(x, counts.to(DEVICE), probs)
    out.backward(upstream)
    return out.detach(), x.grad, [p.main_grad.clone() for p in params]


def fallback_check(experts, recompute: bool, zero_grads) -> dict:
    """The experts forced onto transformer-engine's grouped linears against their grouped-GEMM path, the same
    adapters, tokens and counts."""
    counts, hidden, probs, upstream = tokens(experts)
    _, params = expert_loras(experts)
    experts.activation_recompute = recompute
    runs = {}
    for grouped_mm in (True, False):
        experts.grouped_mm = grouped_mm
        runs[grouped_mm] = run_experts(experts, counts, hidden, probs, upstream, params, zero_grads)
    experts.grouped_mm = True
    (out, grad, grads), (want, want_grad, want_grads) = runs[False], runs[True]
    return {"output": relative(out, want), "input_grad": relative(grad, want_grad),
            "adapter_grads": max(relative(g, w) for g, w in zip(grads, want_grads)),
            "adapters": len(params), "tokens": int(counts.sum())}


def fp8_check(experts, zero_grads) -> dict:
    """FP8-built experts (on transformer-engine's grouped linears) in megatron-core's FP8 context: finite forward
    and backward; the adapters' contribution against the bf16 grouped-GEMM path's for the same adapters."""
    counts, hidden, probs, upstream = tokens(experts, multiple=16)  # as the router's FP8 padding gives them
    loras, params = expert_loras(experts)
    bs = list(dict.fromkeys(lora.b for fc in FC for lora in loras[fc]))
    experts.activation_recompute = False
    saved = [b.detach().clone() for b in bs]

    def run(grouped_mm: bool, fp8: bool, b_zero: bool) -> tuple:
        with torch.no_grad():
            for b, value in zip(bs, saved):
                b.copy_(torch.zeros_like(value) if b_zero else value)
        experts.grouped_mm = grouped_mm
        return run_experts(experts, counts, hidden, probs, upstream, params, zero_grads, fp8)

    adapted, base = run(False, True, False), run(False, True, True)
    want, want_base = run(True, False, False)[0].float(), run(True, False, True)[0].float()
    experts.grouped_mm = False
    with torch.no_grad():
        for b, value in zip(bs, saved):
            b.copy_(value)
    contribution, wanted = adapted[0].float() - base[0].float(), want - want_base
    finite = all(bool(torch.isfinite(t).all()) for t in (adapted[0], adapted[1], *adapted[2], base[0]))
    return {"finite": finite,
            "adapter_grads_nonzero": sum(bool(g.abs().sum() > 0) for g in adapted[2]), "adapters": len(params),
            "contribution": float((contribution - wanted).norm() / wanted.norm().clamp_min(1e-30)),
            # the contribution against the base's output: FP8's error is relative to the whole output
            "contribution_share": float(wanted.norm() / want_base.norm().clamp_min(1e-30)),
            "fp8_vs_bf16_output": float((adapted[0].float() - want).norm() / want.norm().clamp_min(1e-30)),
            "tokens": int(counts.sum())}


def experts_check(experts, recompute: bool, zero_grads) -> dict:
    """The experts' grouped forward with adapters against a per-expert loop in fp32."""
    from mimo.plugins.kit.grouped_mm_moe import expert_weights

    config = experts.config
    counts, hidden, probs, upstream = tokens(experts)
    rows = int(counts.sum())
    loras, params = expert_loras(experts)

    experts.activation_recompute = recompute
    zero_grads()
    out, _ = experts(hidden, counts.to(DEVICE), probs)
    out.backward(upstream)  # adapter gradients land in DDP's main_grad (some added there by the grouped GEMMs)
    grads = [hidden.grad, *(p.main_grad for p in params)]

    weights = [[w.detach().float() for w in ws] for ws in expert_weights(experts)]
    leaves = [p.detach().float().requires_grad_() for p in params]
    leaf = dict(zip(map(id, params), leaves))
    x = hidden.detach().float().requires_grad_()
    pieces, start = [], 0
    for e, n in enumerate(counts.tolist()):
        part, p = x[start:start + n], probs[start:start + n].float().unsqueeze(-1)
        terms = []
        for fc, w in zip(FC, weights):
            lora = loras[fc][e]
            terms.append((w[e], leaf[id(lora.a)], leaf[id(lora.b)], lora.scale))
        (w1, a1, b1, s1), (w2, a2, b2, s2) = terms
        up = part @ w1.T + s1 * (part @ a1.T) @ b1.T
        inner = config.activation_func(up) * p
        pieces.append(inner @ w2.T + s2 * (inner @ a2.T) @ b2.T)
        start += n
    want = torch.cat(pieces)
    want_grads = torch.autograd.grad(want, [x, *leaves], upstream.float())
    return {"output": relative(out, want),
            "input_grad": relative(grads[0], want_grads[0]),
            "adapter_grads": max(relative(g, w) for g, w in zip(grads[1:], want_grads[1:])),
            "adapters": len(params), "tokens": rows}


def adapter_keys(model) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = model.sharded_state_dict()
    apply_factories(state)
    return sorted((e.key, tuple(e.global_shape), tuple(e.global_offset), e.replica_id)
                  for e in nested_values(state) if isinstance(e, ShardedTensor) and "lora" in e.key)


def logits(model, batch) -> torch.Tensor:
    inputs = to_device({k: v for k, v in batch.items() if k not in ("modality_inputs", "labels")},
                       DEVICE, torch.float32)
    with torch.no_grad():
        output, _ = model(**inputs, modality_inputs=to_device(batch["modality_inputs"], DEVICE,
                                                               torch.float32) or None)
    return output.float()


def model_fp8_check(model, batch) -> dict:
    """The FP8-built model's forward and backward (megatron-core's FP8 context around its layers): finite loss and
    finite expert adapter gradients, some of them nonzero."""
    model.train()
    model.zero_grad_buffer()
    inputs = to_device({k: v for k, v in batch.items() if k != "modality_inputs"}, DEVICE, torch.float32)
    output, _ = model(**inputs, modality_inputs=to_device(batch["modality_inputs"], DEVICE, torch.float32) or None)
    output.float().sum().backward()
    grads = [p.main_grad for n, p in adapter_parameters(model) if ".experts." in n]
    return {"finite": bool(torch.isfinite(output).all()) and all(bool(torch.isfinite(g).all()) for g in grads),
            "expert_adapter_grads_nonzero": sum(bool(g.abs().sum() > 0) for g in grads),
            "expert_adapters": len(grads)}


def fp8_reports(layout: str) -> tuple[list[dict], bool]:
    """The te backend's experts built with --fp8 (bf16): each recipe's report and whether a check failed."""
    reports, failed = [], False
    for recipe in ("tensorwise", "delayed"):
        model, batch = build("te", layout, "bf16", fp8=recipe)
        layers = moe_experts(model)
        report = {"layout": layout, "fp8": recipe, "grouped_mm": any(e.grouped_mm for e in layers)}
        checks = [fp8_check(e, model.zero_grad_buffer) for e in layers]
        report["experts"] = {k: (min if k in ("finite", "adapter_grads_nonzero") else max)(c[k] for c in checks)
                             for k in checks[0]}
        report["model"] = model_fp8_check(model, batch)
        failed |= (report["grouped_mm"] or not report["experts"]["finite"] or not report["model"]["finite"]
                   or report["experts"]["adapter_grads_nonzero"] == 0
                   or report["model"]["expert_adapter_grads_nonzero"] == 0
                   or report["experts"]["contribution"] > FP8_TOLERANCE)
        reports.append(report)
    return reports, failed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--backend", default="te", help="te: GroupedMMExperts; local: GroupedMMSequentialMLP")
    arguments = parser.parse_args()
    precision = arguments.precision
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    tolerance = 1e-5 if precision == "fp32" else 3e-2
    failed = False
    for layout in ("shared", "per-expert", "shared-outer"):
        model, batch = build(arguments.backend, layout, precision)
        layers = moe_experts(model)
        report = {"layout": layout, "precision": precision, "classes": sorted({type(e).__name__ for e in layers}),
                  "grouped_mm": all(e.grouped_mm for e in layers)}
        import importlib.util

        # megatron-core's activation checkpoint reads transformer-engine's FP8 state
        # the fallback: transformer-engine's grouped linears (te), megatron-core's per-expert linears (local)
        for recompute in (False, True) if importlib.util.find_spec("transformer_engine") else (False,):
            for name, check in (("", experts_check), ("fallback,", fallback_check)):
                checks = [check(e, recompute, model.zero_grad_buffer) for e in layers]
                report[f"{name}recompute={recompute}"] = {k: max(c[k] for c in checks) for k in checks[0]}
                failed |= any(c[k] > tolerance for c in checks for k in ("output", "input_grad", "adapter_grads"))
        for e in layers:
            e.activation_recompute = False
        local, _ = build("local", layout, precision, expert_gemm="megatron")
        report["keys_as_sequential_mlp"] = adapter_keys(model) == adapter_keys(local)
        model.eval()
        adapted = logits(model, batch)
        report["merged_weights"] = merge_adapters(model)
        report["merged_vs_adapted"] = relative(logits(model, batch), adapted)
        report["classes_after_merge"] = sorted({type(e).__name__ for e in moe_experts(model)})
        failed |= not report["keys_as_sequential_mlp"] or report["merged_vs_adapted"] > 10 * tolerance
        print(json.dumps(report), flush=True)
        if arguments.backend == "te" and DEVICE.type == "cuda":  # FP8: transformer-engine on a GPU
            reports, fp8_failed = fp8_reports(layout)
            failed |= fp8_failed
            for report in reports:
                print(json.dumps(report), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
