"""`mimo plan`: the layout a `mimo run` with the same options would use, checked, without starting workers."""

from __future__ import annotations

import dataclasses
import json
import shutil

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from mimo.wording import counted

WIDE = 120  # the width when stdout is no terminal and COLUMNS is unset (a log file, a pipe)


def describe(plan, estimates=None, limit=None) -> dict:
    """The plan as `mimo plan --json` prints it; `estimates` and `limit` (core/memory/fit.py) add the memory."""
    from mimo.core.memory import pack_budget
    from mimo.core.memory.fit import summary
    from mimo.core.step_time.workload import forward_flops

    modules = []
    for name, par in plan.parallelism.items():
        shape, shards = plan.shapes[name], plan.layout.model_shards(name)
        modules.append({
            "module": name, "ranks": [par.first_rank, par.first_rank + par.num_ranks - 1],
            "tp": par.tp, "cp": par.cp, "dp": par.dp, "pp": par.pp, "ep": par.ep, "expert_tp": par.expt_tp,
            "layers": shape.num_layers, "parameters": shape.num_parameters,
            "active_parameters": shape.num_active_parameters,
            # Sharded weights divide by the model-parallel size; norms and biases repeat, so this is approximate.
            "parameters_per_rank": shape.num_parameters // shards if shape.num_parameters else None,
        })
    encoder_dp = [plan.parallelism[n].dp for n in plan.layout.encoders]
    return {
        "provider": plan.config.provider, "world_size": plan.world_size,
        "layout": "colocated" if plan.config.layout.encoder_ranks == 0 else "heterogeneous",
        "modules": modules, "global_batch_size": plan.global_batch_size,
        "micro_batch_size": plan.config.training.micro_batch_size, "num_microbatches": plan.num_microbatches,
        "encoder_pass": "step" if plan.step_encoders else "micro-batch",
        "encoders_recomputed": plan.encoders_recomputed,
        "llm_data_parallel_lanes": plan.num_lanes, "encoder_data_parallel": encoder_dp[0] if encoder_dp else None,
        "train_iters": plan.train_iters, "valid": True, "memory": summary(estimates, limit),
        "hf_export": _hf_export(plan), "forward_flops_per_sample": forward_flops(plan),
        "pack_image_tokens": plan.pack_image_tokens, "packs": pack_budget.describe(plan),
        "pack_scan": dataclasses.asdict(plan.pack_scan) if plan.pack_scan is not None else None,
        "adapters": _adapters(plan),
    }


def _adapters(plan) -> dict | None:
    """A LoRA plan's adapters: options and targets, at most how many parameters train (the memory plan's bound,
    core/adapters/size.py) against the model's, the base, and whether checkpoints export as PEFT adapters."""
    from mimo.core.memory.fit import adapter_bounds
    from mimo.core.run.preflight import peft_note

    if not plan.adapter_targets:
        return None
    a, c = plan.config.adapters, plan.config.checkpoint
    bounds = adapter_bounds(plan)
    counts = [shape.num_parameters for shape in plan.shapes.values()]
    base = sum(counts) if counts and all(counts) else None
    at_most = sum(bounds.values()) if bounds else None
    folders = {f"--{n.replace('_', '-')}": str(getattr(c, n)) for n in ("pretrained", "pretrained_llm",
                                                                          "pretrained_vision") if getattr(c, n)}
    note = peft_note(plan)
    return {"rank": a.lora_rank, "alpha": a.scale * a.lora_rank, "experts": a.lora_experts, "dropout": a.lora_dropout,
            "targets": {m: list(names) for m, names in plan.adapter_targets.items()},
            "parameters_at_most": bounds, "trainable_at_most": at_most,
            "share_at_most": at_most / (base + at_most) if at_most and base else None,
            "base": " ".join(f"{flag} {path}" for flag, path in folders.items()) or
            f"the provider's initialization (--seed {plan.config.training.seed})",
            "peft_export": note is None, "note": note}


def _adapter_line(adapters: dict) -> str:
    from mimo.core.run.lora_report import targets_text

    trainable = (f"at most {adapters['trainable_at_most']:,} trainable parameters"
                 + (f" ({100 * adapters['share_at_most']:.1f}% of the model)" if adapters["share_at_most"] else "")
                 if adapters["trainable_at_most"] else "trainable parameters not estimated (no module_memory hook)")
    return (f"LoRA adapters: rank {adapters['rank']}, alpha {adapters['alpha']:g}, experts {adapters['experts']} "
            f"on {targets_text(adapters['targets'])}; {trainable}; base {adapters['base']}, frozen")


def _hf_export(plan) -> dict | None:
    """Whether checkpoints of the plan's settings export to Hugging Face, and which settings stop them."""
    from mimo.core.checkpoint.hf import plain_value

    refused = plan.hooks.hf_export_check(settings=plan.settings)
    if refused is None:
        return None
    return {"exportable": not refused, "settings": {k: {"value": plain_value(have), "needed": plain_value(need)}
                                                    for k, (have, need) in refused.items()}}


def print_plan(summary: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    rows = []
    for m in summary["modules"]:
        total = f"{m['parameters']:,}" if m["parameters"] else "?"
        if m["active_parameters"]:
            total += f"\n({m['active_parameters']:,} active)"
        rows.append([m["module"], f"{m['ranks'][0]}-{m['ranks'][1]}", str(m["tp"]), str(m["cp"]), str(m["dp"]),
                     str(m["pp"]), str(m["ep"]), str(m["layers"]), total,
                     f"{m['parameters_per_rank']:,}" if m["parameters_per_rank"] else "?"])
    console = terminal_console()
    title = f"{summary['provider']}: {summary['layout']} layout on {counted(summary['world_size'], 'rank')}"
    console.print(fitted(["module", "ranks", "TP", "CP", "DP", "PP", "EP", "layers", "parameters", "per rank (≈)"],
                         rows, console.width, title))
    if summary.get("adapters"):
        console.print(_adapter_line(summary["adapters"]), highlight=False)
        if summary["adapters"]["note"]:
            console.print(summary["adapters"]["note"], highlight=False)
    if summary.get("memory"):
        console.print(memory_table(summary["memory"], console.width))
    elif "memory" in summary:
        console.print("memory: not estimated (the provider has no module_memory hook)")
    if summary.get("hf_export") and not summary["hf_export"]["exportable"]:
        from mimo.core.checkpoint.hf_export import not_exportable

        refused = {k: (v["value"], v["needed"]) for k, v in summary["hf_export"]["settings"].items()}
        console.print(f"note: checkpoints of these settings cannot be exported to Hugging Face: "
                      f"{not_exportable(refused)}")
    if summary.get("forward_flops_per_sample"):
        console.print(_flop_split(summary["forward_flops_per_sample"]))
    if summary.get("packs"):
        console.print(summary["packs"])
    console.print(f"global batch {summary['global_batch_size']} = "
                  f"{counted(summary['num_microbatches'], 'micro-batch')} x "
                  f"{counted(summary['micro_batch_size'], 'sample')} x "
                  f"{counted(summary['llm_data_parallel_lanes'], 'LLM lane')}"
                  f"{_encoder_pass(summary)}; {counted(summary['train_iters'], 'iteration')}.")
    # the verdict on a line of its own: at 80 columns the line above wraps, and a verdict split over two lines
    # reads as neither
    console.print("Layout valid." if summary["valid"] else "Layout does not fit.")


def _flop_split(flops: dict[str, float]) -> str:
    """Which module carries the work: a split pays off only where the encoders carry a large share."""
    total = sum(flops.values())
    scale, unit = (1e12, "TFLOP") if total >= 1e11 else (1e9, "GFLOP") if total >= 1e8 else (1e6, "MFLOP")
    parts = ", ".join(f"{name} {value / scale:.2f} {unit} ({value / total:.0%})" for name, value in flops.items())
    return f"forward FLOPs per sample: {parts}"


def _encoder_pass(summary: dict) -> str:
    if summary["encoder_pass"] != "step":
        return ""
    return " (encoders once per step" + (", recomputed in backward to fit)" if summary["encoders_recomputed"]
                                         else ")")


def memory_table(memory: dict, width: int = WIDE):
    limit = memory["limit"]
    title = "memory per GPU, GiB" + (f" (limit {limit:.0f}: {memory['limit_source']})" if limit else " (no limit: CPU)")
    rows = []
    for r in memory["ranks"]:
        modules = ", ".join(f"{m['module']} ({m['recompute']}, {m['micro_batches_in_flight']} in flight)"
                            if m["recompute"] != "none" or m["micro_batches_in_flight"] > 1 else m["module"]
                            for m in r["modules"])
        headroom = f"{r['headroom']:.1f}" if r["headroom"] is not None else "-"
        rows.append([f"{r['kind']} {r['ranks'][0]}-{r['ranks'][1]}", modules,
                     *(f"{r[k]:.1f}" for k in ("parameters", "gradients", "optimizer", "activations", "allowance",
                                               "total")),
                     f"{limit:.0f}" if limit else "-", headroom if r["fits"] else f"[red]{headroom}[/red]"])
    return fitted(["ranks", "modules", "params", "grads", "optimizer", "activations", "allowance", "total", "limit",
                   "headroom"], rows, width, title, caption=f"allowance: {memory['allowance_rule']}")


def fitted(headers: list[str], rows: list[list[str]], width: int, title: str, caption: str | None = None):
    """A table that fits `width` columns and never cuts a word: as it is; else with its cells wrapped between
    words; else turned (a row per column, for many columns and few rows); else each row as lines of `name value`."""
    for shape in ("rows", "columns"):
        head, body = (headers, rows) if shape == "rows" else \
            ([""] + [row[0] for row in rows], [[h] + [row[i] for row in rows] for i, h in enumerate(headers) if i])
        cells = [[Text.from_markup(c) for c in [*head]]] + [[Text.from_markup(c) for c in row] for row in body]
        longest = [max(max(len(line) for line in row[i].plain.split("\n")) for row in cells) for i in range(len(head))]
        word = [max(max((len(w) for w in row[i].plain.split()), default=0) for row in cells) for i in range(len(head))]
        frame = 3 * len(head) + 1  # rich's box: a bar and a space either side of each cell
        if sum(word) + frame > width:
            continue
        widths, spare = list(word), width - frame - sum(word)
        for i in sorted(range(len(head)), key=lambda i: longest[i] - word[i]):  # the least wrapping first: whole
            widths[i] += min(spare, longest[i] - word[i])
            spare -= widths[i] - word[i]
        table = Table(title=title, caption=caption, show_header=shape == "rows" or any(head))
        for name, column_width in zip(head, widths):
            table.add_column(name, width=column_width, overflow="fold")
        for row in cells[1:]:
            table.add_row(*row)
        return table
    lines = [Text(title, style="italic")]
    for row in rows:  # too narrow even turned: each row stacked
        lines.append(Text(f"{headers[0]} {Text.from_markup(row[0]).plain}", style="bold"))
        lines += [Text(f"  {h}: {Text.from_markup(c).plain}".replace("\n", " ")) for h, c in zip(headers[1:], row[1:])]
    if caption:
        lines.append(Text(caption, style="italic"))
    return Group(*lines)


def terminal_console() -> Console:
    """The terminal's width (COLUMNS where set), or WIDE where there is none."""
    return Console(width=shutil.get_terminal_size((WIDE, 24)).columns)
