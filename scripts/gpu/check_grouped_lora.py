"""LoRA on transformer-engine's grouped experts run as mimo's grouped GEMMs (`GroupedMMExperts`, the te backend's
experts) on a GPU, the tiny Nemotron with adapters on its routed experts, every layout:

* each MoE layer's experts with adapters against a per-expert loop in fp32 (weights weight0..N, each expert's
  A and B): outputs and adapter gradients, with the activation kept and recomputed (selective recompute);
* the adapters' checkpoint keys are those of the local backend's SequentialMLP experts;
* merging folds them into weight0..N: the merged model's logits are the adapted model's.

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
from mimo.core.config import AdapterOptions, RunConfig, TrainingOptions
from mimo.core.forward.batch_transfer import to_device
from mimo.core.run.plan import prepare
from mimo.core.run.world import join

RANK, TOKENS = 4, 96
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: the script's own check


def build(backend: str, layout: str, precision: str, expert_gemm: str = "grouped_mm"):
    plan = prepare(RunConfig(provider="nemotron-moe-vlm-tiny",
                             provider_settings=[f"backend={backend}", f"expert_gemm={expert_gemm}"],
                             training=TrainingOptions(device=DEVICE.type, micro_batch_size=2, precision=precision),
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


def experts_check(experts, recompute: bool, zero_grads) -> dict:
    """The experts' grouped forward with adapters against a per-expert loop in fp32."""
    from mimo.plugins.kit.grouped_mm_moe import expert_weights

    config = experts.config
    count = experts.num_local_experts
    hidden_size = config.hidden_size
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    counts = torch.multinomial(torch.ones(count), TOKENS, replacement=True).bincount(minlength=count)
    counts[0] = 0  # an expert without tokens
    rows = int(counts.sum())
    dtype = config.params_dtype
    hidden = torch.randn(rows, hidden_size, device=DEVICE, generator=generator).to(dtype).requires_grad_()
    probs = torch.rand(rows, device=DEVICE, generator=generator).to(dtype)
    upstream = torch.randn(rows, hidden_size, device=DEVICE, generator=generator).to(dtype)
    adapters = {fc: adapters_of(experts, fc) for fc in FC}
    loras = {fc: a if isinstance(a, list) else [a] * count for fc, a in adapters.items()}
    params = list(dict.fromkeys(p for fc in FC for lora in loras[fc] for p in (lora.a, lora.b)))

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
        for recompute in (False, True) if importlib.util.find_spec("transformer_engine") else (False,):
            checks = [experts_check(e, recompute, model.zero_grad_buffer) for e in layers]
            report[f"recompute={recompute}"] = {k: max(c[k] for c in checks) for k in checks[0]}
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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
