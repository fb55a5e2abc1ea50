"""`mimo plan --suggest --gpus N`: the layouts of N GPUs that fit, as a table a terminal of 80 columns shows whole
(tokens/s/GPU first, each layout's global batch in samples and tokens, its options on a line of their own, never
broken inside an option) or as JSON, and the `mimo run` command of the first, whole: one option a line."""

from __future__ import annotations

import dataclasses
import enum
import json
import shlex

import typer

from mimo.wording import counted

# `mimo plan`'s own options, and those each layout sets: the command of a layout leaves out what the user typed
PLAN_ONLY = {"as_json", "suggest", "gpus"}
SET_BY_LAYOUT = {"sequence_parallel", "use_distributed_optimizer", "recompute", "nproc_per_node"}


def typed_options(ctx) -> list[tuple[str, list[str]]]:
    """The options typed on the command line (typer's context): (parameter, its argv words), in --help's order."""
    if ctx is None:
        return []
    out = []
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        value = ctx.params.get(param.name)
        if source is None or source.name in ("DEFAULT", "DEFAULT_MAP") or value is None or not param.opts:
            continue
        name = max(param.opts, key=len)
        if getattr(param, "is_flag", False):
            if value or param.secondary_opts:
                out.append((param.name, [name if value else max(param.secondary_opts, key=len)]))
            continue
        for v in (value if getattr(param, "multiple", False) else [value]):
            out.append((param.name, [name, str(v.value if isinstance(v, enum.Enum) else v)]))
    return out


def recompute_value(modes: dict[str, str], modules: list[str]) -> str | None:
    """--recompute's value for `modes` ({module or "*": mode}), every module of the plan named where they differ;
    None where nothing is recomputed."""
    each = {name: modes.get(name, modes.get("*", "none")) for name in modules}
    if len(set(each.values())) == 1:
        mode = next(iter(each.values()))
        return None if mode == "none" else mode
    return ",".join(f"{name}={mode}" for name, mode in each.items() if mode != "none")


def command(suggestion, gpus: int, config, typed: list[tuple[str, list[str]]], user_modes: dict[str, str],
            modules: list[str]) -> list[list[str]]:
    """`mimo run` with this layout: the options typed (less those the layout sets) and the layout's, each option
    as its argv words. Under --config the layout's sizes are written even at 1, where the file may set others."""
    from mimo.core.config import LayoutOptions
    from mimo.plugins import LANGUAGE

    layout_fields = {f.name for f in dataclasses.fields(LayoutOptions)}
    kept = [words for name, words in typed if name not in PLAN_ONLY | SET_BY_LAYOUT | layout_fields]
    words = [["mimo", "run"], ["--nproc-per-node", str(gpus // config.launch.nnodes)]] + kept
    own = [option.split(" ", 1) for option in suggestion.options_list() if not option.startswith("--recompute")]
    if config.config_file is not None:  # sizes the file may set, now given whatever their value
        shown = {o[0] for o in own}
        for f in dataclasses.fields(LayoutOptions):
            value, flag = getattr(suggestion.layout, f.name), f"--{f.name.replace('_', '-')}"
            if flag not in shown and value != getattr(config.layout, f.name):
                own.append([flag, str(value)])
    modes = dict(user_modes)
    if modes.get(LANGUAGE, modes.get("*", "none")) != suggestion.recompute:
        modes[LANGUAGE] = suggestion.recompute
    recompute = recompute_value(modes, modules)
    return words + own + ([["--recompute", recompute]] if recompute else [])


def command_lines(words: list[list[str]]) -> list[str]:
    """The command as shell lines: one option a line, ` \\` continuing it."""
    lines = [shlex.join(option) for option in words]
    return [("" if i == 0 else "  ") + line + (" \\" if i < len(lines) - 1 else "") for i, line in enumerate(lines)]


def _gib(value: float) -> str:
    return f"{value:.0f}" if value == round(value) else f"{value:.1f}"


def table_lines(rows: list[dict], timed: bool, width: int) -> list[str]:
    """The layouts as columns of figures, each followed by its options on lines of `width`, broken between
    options only."""
    headers = ["#"] + (["tokens/s/GPU"] if timed else []) + ["global batch"] + (["ms/iter"] if timed else []) \
        + ["peak GiB", "headroom"]
    cells = []
    for i, row in enumerate(rows, 1):
        batch = f"{row['global_batch_samples']:,} ({row['global_batch_tokens']:,.0f} tokens)"
        cells.append([str(i)] + ([f"{row['tokens_per_s_per_gpu']:,.0f}"] if timed else []) + [batch]
                     + ([row["ms_text"]] if timed else []) + [f"{row['largest_rank_gib']:.1f}",
                                                              f"{row['headroom_gib']:.1f}"])
    widths = [max(len(c[i]) for c in [headers] + cells) for i in range(len(headers))]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) for v, w in zip(values, widths)).rstrip()

    out = [line(headers)]
    indent = " " * (widths[0] + 2)
    for row, values in zip(rows, cells):
        out.append(line(values))
        current = indent
        for option in row["options"] or ["(colocated, data parallel only)"]:
            if current.strip() and len(current) + 1 + len(option) > width:
                out.append(current)
                current = indent
            current += (" " if current.strip() else "") + option
        out.append(current)
    return out


def print_suggestions(config, gpus: int, as_json: bool, typed: list[tuple[str, list[str]]] = ()) -> None:
    """`mimo plan --suggest --gpus N`: the layouts that fit, most tokens/s/GPU first, as a table or JSON."""
    from mimo.core.config import LayoutOptions
    from mimo.core.memory import fit
    from mimo.core.run.plan import prepare
    from mimo.core.step_time.advisor import advise, memory_limit, milliseconds
    from mimo.errors import UsageError

    from .plan import terminal_console

    if gpus % config.launch.nnodes:
        raise UsageError(f"--gpus {gpus} is not the same number of GPUs on each of --nnodes {config.launch.nnodes} "
                         f"nodes: give a multiple of {config.launch.nnodes}")
    user_modes = config.performance.recompute_modes()  # before the plan's --encoder-pass auto changes them
    # the search lays the modules out itself: the run's own layout options need not suit N GPUs; on a host without
    # a GPU, --device auto plans for GPUs (the provider's GPU backend), as the memory limit does
    training = config.training
    if training.device == "auto" and fit.visible_gpu_gib() is None:
        training = dataclasses.replace(training, device="cuda")
    plan = prepare(dataclasses.replace(config, layout=LayoutOptions(), training=training), world_size=gpus,
                   planning=True)
    limit, source = memory_limit(plan.config)
    advised = advise(plan, gpus, limit)
    if not advised.layouts:
        raise UsageError(f"no layout of {counted(gpus, 'GPU')} fits {_gib(limit)} GiB ({source}) with these "
                         f"options, even with the distributed optimizer and full recomputation: use more GPUs or a "
                         f"smaller --micro-batch-size")
    rows = []
    for a in advised.layouts:
        s, est = a.suggestion, a.estimate
        words = command(s, gpus, config, list(typed), user_modes, list(plan.parallelism))
        rows.append({"flags": s.flags(), "options": s.options_list(), "layout": dataclasses.asdict(s.layout),
                     "sequence_parallel": s.sequence_parallel,
                     "use_distributed_optimizer": s.distributed_optimizer, "recompute": s.recompute,
                     "num_microbatches": s.num_microbatches, "global_batch_samples": s.global_batch,
                     "global_batch_tokens": s.global_batch * advised.tokens_per_sample,
                     "largest_rank_gib": s.largest_gib, "headroom_gib": s.headroom_gib,
                     "communication_cost": s.cost, "ms_per_iteration": est.seconds * 1e3 if est else None,
                     "ms_text": milliseconds(est.seconds) if est else None,
                     "tokens_per_s_per_gpu": a.tokens_per_s_per_gpu,
                     "slower_stage": (f"{est.slowest.name} {est.slowest.ranks[0]}-{est.slowest.ranks[1]}"
                                      if est else None),
                     "why": a.why or None, "command": [w for option in words for w in option], "words": words})
    if as_json:
        typer.echo(json.dumps({"provider": config.provider, "gpus": gpus, "limit_gib": limit,
                               "limit_source": source, "ordered_by": "tokens_per_s_per_gpu" if advised.verdict
                               else "communication_cost", "use": advised.verdict or None, "note": advised.note,
                               "layouts": [{k: v for k, v in row.items() if k not in ("words", "ms_text")}
                                           for row in rows]}, indent=2))
        return
    console = terminal_console()
    timed = bool(advised.verdict)

    def say(text: str) -> None:
        console.print(text, highlight=False, markup=False)

    order = "most tokens/s/GPU first" if timed else "least communication first"
    say(f"{config.provider}: layouts of {counted(gpus, 'GPU')} that fit {_gib(limit)} GiB ({source}), {order}")
    for text in table_lines(rows, timed, console.width):
        say(text)
    if len({row["global_batch_samples"] for row in rows}) > 1:
        say("note: the global batch follows each layout's LLM data-parallel lanes (--micro-batch-size x DP); "
            "--global-batch-size N lists layouts of one batch")
    for i, row in enumerate(rows, 1):
        if row["why"]:
            say(f"#{i} {row['why']}")
    say((advised.verdict + ":") if advised.verdict else "#1 as a command:")
    for text in command_lines(rows[0]["words"]):
        typer.echo(text)  # whole, never wrapped: each line copies as it is
    if advised.note:
        say(f"note: {advised.note}")
