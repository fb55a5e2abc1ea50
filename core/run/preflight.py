"""Every start-up check of a command, in one call, before any worker starts: a problem is one line (exit 2) from
the process the user started, not a traceback from a worker.

    with preflight.for_run(config) as plan:     # `mimo run`
        ...start the workers, or train in this process
    with preflight.for_eval(config, split) as plan:   # `mimo eval`

For `mimo run`: the plan (options, provider, settings, layout), the memory estimate against the GPU, what
`--pretrained` and the Hugging Face parts (`--pretrained-llm`, `--pretrained-vision`) point at: each folder's
tensors against the provider's map, from the headers alone (every rank then loads its own slices; there is no
conversion step, so torchrun and srun need none either), what `--load` means, and then the paths the run writes
and the save directory's lock: what only reads comes first, so a refused run leaves nothing behind. Workers
repeat the plan and the cheap checks; the memory check was made for them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from mimo.data.check import check_dataset, foreign_notes
from mimo.data.splits import check_split

from ..checkpoint import hf
from ..checkpoint.foreign import foreign_directory
from ..checkpoint.hf_export import export_note
from ..checkpoint.peft_export import shared_outer_note
from ..checkpoint.resume import check_resume
from ..checkpoint.save_dir import remove_unfinished
from ..checkpoint.save_lock import check_not_in_use, lock_save_directory
from ..config import RunConfig
from ..evaluation.predictions import check_predictions
from ..memory import fit
from . import launch
from .evaluate import eval_config
from .output_paths import check_output_paths
from .plan import Plan, prepare


@contextlib.contextmanager
def for_run(config: RunConfig) -> Iterator[Plan]:
    """The checked plan of `mimo run`; raises UsageError at the first problem."""
    plan = prepare(config)  # every check that needs no process group, before any worker starts
    launch.check_rendezvous_host(config.launch.rdzv_endpoint)
    check_predictions(plan)  # --eval-samples: a dataset with answers, a provider and a layout that generate
    if not os.environ.get(launch.LAUNCHED_BY_MIMO):  # mimo's launcher checked this plan for its workers
        fit.check(plan)  # the largest rank's memory estimate against --gpu-memory / the GPU's
    speaks = launch.speaks_for_run(config.launch)
    _check_datasets(config, speak=speaks)
    # What only reads comes before what writes: a refused run leaves no --save folder (nor its lock) behind.
    check_pretrained(plan)
    if speaks and config.checkpoint.save is not None:
        check_not_in_use(config.checkpoint.save)  # a live run's folder: said first, whatever it holds
    # --load: a checkpoint, the empty --save directory, or an error; --save: no other run's checkpoint replaced
    check_resume(config, speak=speaks, train_iters=plan.train_iters)
    check_output_paths(config)  # likewise every path the run writes: created and test-written now
    if speaks and config.checkpoint.save is not None:
        lock_save_directory(config.checkpoint.save)  # held until this process exits
        for line in remove_unfinished(config.checkpoint.save):  # what killed saves left; complete ones stay
            print(line, flush=True)
    if speaks and config.checkpoint.save is not None:
        for note in (export_note(plan.hooks, plan.settings), peft_note(plan)):
            if note:
                print(note, flush=True)  # before training, not after it: these settings decide
    yield plan


@contextlib.contextmanager
def for_eval(config: RunConfig, split: str) -> Iterator[Plan]:
    """The checked plan of `mimo eval`: the checkpoint's weights only, `--eval-iters` batches of `split`."""
    plan = prepare(eval_config(config, split))
    check_predictions(plan)
    _check_datasets(plan.config, split=split)
    check_pretrained(plan)
    yield plan


def peft_note(plan: Plan) -> str | None:
    """The line saying a LoRA run's checkpoints cannot be exported as PEFT adapters (None: they can, or no LoRA)."""
    if not plan.adapter_targets:
        return None
    experts = [name for name, shape in plan.shapes.items() if shape.num_experts]
    return shared_outer_note(plan.config.adapters, plan.adapter_targets, experts)


def check_pretrained(plan: Plan) -> None:
    """--pretrained names a checkpoint or a Hugging Face folder, and Hugging Face folders fit the provider's maps."""
    c = plan.config.checkpoint
    if c.pretrained and not hf.is_hf_folder(c.pretrained):
        foreign_directory(c.pretrained)  # a folder holding no checkpoint is one line before workers start
    hf.check_sources(plan)


def _check_datasets(config: RunConfig, speak: bool = True, split: str = "val") -> None:
    """A dataset whose declared sample class cannot be imported is one line now, not a traceback from the loader;
    one of another framework's classes that mimo reads as its own format is said once. The dataset evaluations
    read (--eval-data, else --data) without the eval `split` is one line naming that option."""
    for flag, path in (("--data", config.data.data), ("--eval-data", config.evaluation.eval_data)):
        if path is not None:
            check_dataset(path, flag)
            for note in foreign_notes(path, flag) if speak else ():
                print(note, flush=True)
    e = config.evaluation
    if e.eval_iters and (e.eval_data or config.data.data):
        flag, path = ("--eval-data", e.eval_data) if e.eval_data else ("--data", config.data.data)
        check_split(path, split, flag)
