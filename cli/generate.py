"""`mimo generate`: answers of a checkpoint or a Hugging Face folder, for a prompt with images or a dataset."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from pathlib import Path
from typing import Annotated

import typer

from mimo.core.config import COMPONENTS
from mimo.errors import UsageError

from .common import fail, start_workers
from .options import CONTEXT, loop_parameters, provider_parameters

# The loop options that mean something to generation; the others keep their defaults.
LOOP_OPTIONS = ("load", "pretrained", "data", "device", "precision", "nproc_per_node", "llm_tp", "encoder_tp",
                "llm_ep", "llm_expt_tp", "distributed_timeout_minutes")
_HELP = {
    "load": "the mimo checkpoint to answer with (a save directory, saved in any layout); its provider, settings "
            "and precision are used",
    "pretrained": "a Hugging Face folder (converted on the fly) or a mimo checkpoint",
    "data": "answer every answer turn of this energon dataset's --split (JSON lines with the references and "
            "scores) instead of --prompt",
}


def _generate(ctx: typer.Context, prompt=None, image=None, system=None, split="val", limit=None, output=None,
              max_new_tokens=256, temperature=0.0, top_p=1.0, top_k=0, seed=1234, as_json=False, **kwargs):
    """Answer a prompt (with --image for each image) or the answer turns of a dataset (--data), from a mimo
    checkpoint (--load) or a Hugging Face folder (--pretrained). Greedy unless --temperature > 0; an answer ends
    at the chat template's end of turn or after --max-new-tokens."""
    from mimo.core.generation.sampling import SamplingOptions
    from mimo.core.run import launch
    from mimo.core.run.generate import GenerateRequest, checked_plan, generate

    from .checkpoint_config import config_from_checkpoint

    launch.die_with_launcher()
    defaults = {f.name: f.default for c in COMPONENTS for f in dataclasses.fields(c.options)}
    kwargs = {**defaults, **kwargs, "seed": seed}
    try:
        request = GenerateRequest(prompt=prompt, images=tuple(image or ()), system=system, split=split, limit=limit,
                                  output=output, max_new_tokens=max_new_tokens, as_json=as_json,
                                  sampling=SamplingOptions(temperature, top_p, top_k, seed))
        request.validate(kwargs.get("data"))  # before anything is read or built
        config, report = config_from_checkpoint(kwargs, ctx, "generate")
        with checked_plan(config, request) as plan:
            if report is not None and not launch.is_launched_worker():
                for line in report(plan):
                    print(line, file=sys.stderr, flush=True)
            if launch.needs_launcher(plan.config.launch):
                raise typer.Exit(code=start_workers(plan))
            generate(plan, request)
    except UsageError as err:
        raise fail(str(err)) from None


def _param(name, kind, default, *names, panel="Generation", **option):
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[
        kind, typer.Option(*names, rich_help_panel=panel, **option)])


def parameters() -> list[inspect.Parameter]:
    loop = []
    for p in loop_parameters():
        if p.name in LOOP_OPTIONS:
            kind, option = typing.get_args(p.annotation)
            if p.name in _HELP:
                option.help = _HELP[p.name]
            loop.append(p)
    return [CONTEXT] + provider_parameters() + [
        _param("prompt", typing.Optional[str], None, "--prompt", help="the question (a user turn); <image> marks "
               "where an image goes, else the images come first"),
        _param("image", typing.Optional[list[Path]], None, "--image", help="an image file for the prompt; repeatable"),
        _param("system", typing.Optional[str], None, "--system", help="a system turn before the prompt"),
        _param("split", str, "val", "--split", help="--data: the split to answer (val, test or train)"),
        _param("limit", typing.Optional[int], None, "--limit", help="--data: answer the first N answer turns only"),
        _param("output", typing.Optional[Path], None, "--output", help="--data: write the JSON lines here (default: "
               "stdout)"),
        _param("max_new_tokens", int, 256, "--max-new-tokens", help="the longest answer, in tokens"),
        _param("temperature", float, 0.0, "--temperature", help="0: greedy (the most likely token); more: sample"),
        _param("top_p", float, 1.0, "--top-p", help="sampling: keep the most likely tokens up to this probability"),
        _param("top_k", int, 0, "--top-k", help="sampling: keep the K most likely tokens (0: all)"),
        _param("seed", int, 1234, "--seed", help="sampling: the seed (prompt i draws from seed + i)"),
        _param("as_json", bool, False, "--json", help="print one JSON object (answer, token ids and counts, stop, "
               "timings) instead of the answer's text"),
    ] + loop


def register(app) -> None:
    from .help import WholeNamesCommand
    from .options import with_options

    app.command("generate", cls=WholeNamesCommand)(with_options(_generate, parameters()))
