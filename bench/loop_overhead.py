"""(c) mimo's training loop against a minimal loop written directly on megatron-core (`minimal_loop.py`).

    python bench/loop_overhead.py --out results/overhead            # one GPU
    python bench/loop_overhead.py --out /tmp/smoke --quick          # the script itself, tiny, on a CPU

Both loops train their own copy of one model (mock-vlm: a 303M ViT and a 0.74B GPT, sequence 2048, bf16,
micro-batch 2 x 4 micro-batches) from the same weights on the same data, in this one process. They take turns in
blocks of iterations, ordered A B B A so that drift (clocks, temperature) cancels; each block is timed between
device synchronizations and the first round is warm-up. mimo's block is its real loop (`mimo.core.run.loop.advance`:
step, metrics and log line, checkpoint checks); the minimal loop's is megatron-core's schedule, MimoOptimizer and
scheduler step and nothing else. As both train the same thing, their losses must agree; the script checks it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from common import Results, bar_plot

MEDIUM = dict(image_size=448, patch_size=14, vision_hidden_size=1024, vision_layers=24, vision_heads=16,
              hidden_size=2048, num_layers=12, num_attention_heads=16, seq_length=2048, vocab_size=32000)
QUICK = dict(image_size=32, patch_size=8, vision_hidden_size=64, vision_layers=2, vision_heads=4, hidden_size=64,
             num_layers=2, num_attention_heads=4, seq_length=128, vocab_size=512)


def build_runs(settings: dict, device: str, precision: str, mbs: int, microbatches: int, iterations: int,
               log_interval: int):
    from megatron.core.optimizer import OptimizerConfig

    from mimo.core.config import RunConfig
    from mimo.core.run.prefetch import read_ahead
    from mimo.core.run.plan import prepare
    from mimo.core.run.session import start
    from mimo.plugins import BuildContext
    from mimo.plugins.data_source import as_data_source
    from minimal_loop import MinimalLoop

    config = RunConfig(provider="mock-vlm", provider_settings=[f"{k}={v}" for k, v in settings.items()])
    t = config.training
    t.device, t.precision, t.micro_batch_size, t.num_microbatches, t.train_iters = (
        device, precision, mbs, microbatches, iterations)
    config.logging.log_interval = log_interval
    plan = prepare(config)
    session = start(plan)  # mimo's loop: process group, grids, model, optimizer, scheduler, data, logger

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    topo = session.topology
    ctx = BuildContext(params_dtype=dtype, parallelism=plan.parallelism, pg_collections=topo.pg_collections)
    encoders = plan.hooks.build_encoders(settings=plan.settings, ctx=ctx)
    o = config.optimizer
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=dtype == torch.bfloat16,
        params_dtype=dtype)
    minimal = MinimalLoop(
        plan.hooks.build_language_model(settings=plan.settings, ctx=ctx),
        {name: e.spec for name, e in encoders.items()}, {name: e.placeholder_token_id for name, e in encoders.items()},
        topo.grids, topo.pg_collections, session.device, dtype, optimizer_config, o.lr, plan.num_microbatches,
        mbs, plan.global_batch_size,
        read_ahead(as_data_source(plan.hooks.data_provider(settings=plan.settings,
                                                           ctx=session.world.data_context(0))),
                   config.data.prefetch_microbatches, session.device),  # the same data path as mimo's loop
        weights_from=session.model)
    minimal.model.train()
    return plan, session, minimal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/overhead"))
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds (each: a block of each loop)")
    parser.add_argument("--block", type=int, default=10, help="iterations per block (also mimo's log interval)")
    parser.add_argument("--quick", action="store_true", help="tiny settings on the CPU: checks the script only")
    args = parser.parse_args()
    settings, device, precision = (QUICK, "cpu", "fp32") if args.quick else (MEDIUM, "cuda", "bf16")
    from mimo.core.run.loop import advance, finish

    rounds = args.rounds + 1  # the first is warm-up
    plan, session, minimal = build_runs(settings, device, precision, 2, 4, rounds * args.block, args.block)
    sync = torch.cuda.synchronize if session.device.type == "cuda" else (lambda: None)

    def mimo_block():
        advance(session, args.block)

    def minimal_block():
        for _ in range(args.block):
            minimal.step()

    times = {"mimo": [], "minimal": []}
    for r in range(rounds):
        order = [("mimo", mimo_block), ("minimal", minimal_block)]
        for name, block in order if r % 2 == 0 else order[::-1]:
            sync()
            started = time.perf_counter()
            block()
            sync()
            if r:
                times[name].append((time.perf_counter() - started) * 1000 / args.block)

    # The loops trained the same model on the same data: compare their losses, block by block.
    mimo_losses = [rec["lm_loss"] for rec in session.logger.records]
    sums = torch.stack(minimal.losses).double().cpu().view(rounds, args.block, 2).sum(1)
    minimal_losses = (sums[:, 0] / sums[:, 1]).tolist()
    loss_gap = max(abs(a - b) / abs(a) for a, b in zip(mimo_losses, minimal_losses))
    records = finish(session)

    ms = {name: statistics.median(values) for name, values in times.items()}
    ratios = [a / b for a, b in zip(times["mimo"], times["minimal"])]
    results = Results("loop_overhead", [
        ("loop", "loop", ""), ("median_ms", "median ms/iter", ".2f"), ("min_ms", "min", ".2f"),
        ("max_ms", "max", ".2f"), ("blocks", "blocks", "d")])
    for name in times:
        results.rows.append({"loop": name, "median_ms": ms[name], "min_ms": min(times[name]),
                             "max_ms": max(times[name]), "blocks": len(times[name]), "ms_per_block": times[name]})
    ratio = statistics.median(ratios)
    results.notes += [
        f"mimo / minimal step time: {ratio:.4f} (median of {len(ratios)} paired rounds; per round: "
        + ", ".join(f"{x:.4f}" for x in ratios) + ")",
        f"losses, mimo vs minimal, per block: largest relative difference {loss_gap:.2e} "
        f"(mimo {mimo_losses[-1]:.6f}, minimal {minimal_losses[-1]:.6f} in the last block)",
    ]
    results.write(args.out, {"settings": settings, "ratio": ratio, "ratios": ratios, "loss_gap": loss_gap,
                             "mimo_losses": mimo_losses, "minimal_losses": minimal_losses,
                             "global_batch": plan.global_batch_size, "mimo_log": records})
    bar_plot(args.out / "loop_overhead.png", ["step time"], {name: [ms[name]] for name in ms}, "ms per iteration",
             f"mimo loop vs minimal megatron-core loop (ratio {ratio:.3f})")


if __name__ == "__main__":
    main()
