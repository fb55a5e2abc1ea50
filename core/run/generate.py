"""`mimo generate`: answers from a checkpoint (any layout it was saved in) or a Hugging Face folder, for one typed
prompt with its images or for the answer turns of a dataset's split.

The world and model are built as for a run (world.py) in the layout asked for (one process, or TP/EP
within a node), the weights load through the resharding path (weights only), and every rank decodes each prompt
together (core/generation/decoder.py); world rank 0 writes: the answer on stdout (or one JSON object with `--json`), or with
`--data` one JSON line per answer and a summary line on stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from mimo.data.check import foreign_notes
from mimo.data.prompts import from_dataset, from_text
from mimo.errors import UsageError
from mimo.wording import counted

from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.hf_load import hf_loader
from ..checkpoint.layout import run_info
from ..checkpoint.resume import NO_SAVING, require_checkpoint
from ..config import RunConfig
from ..generation.answers import answer_all, prompt_format_of
from ..generation.decoder import Decoder, check_plan
from ..generation.sampling import Sampler, SamplingOptions
from ..generation.text_metrics import mean
from .output_paths import check_output_file
from .plan import Plan, prepare
from .preflight import check_pretrained
from .world import join

WAY_OUT = "run mimo generate with --nproc-per-node, --llm-tp, --encoder-tp and --llm-ep only"


@dataclass(frozen=True)
class GenerateRequest:
    """What to answer and how: a typed prompt with images, or a dataset split (`RunConfig.data.data`)."""

    prompt: str | None = None
    images: tuple[Path, ...] = ()
    system: str | None = None
    split: str = "val"
    limit: int | None = None
    output: Path | None = None  # --data: JSON lines here instead of stdout
    max_new_tokens: int = 256
    sampling: SamplingOptions = SamplingOptions()
    as_json: bool = False

    def validate(self, data: Path | None) -> None:
        if (self.prompt is None) == (data is None):
            raise UsageError("mimo generate needs one of --prompt TEXT (with --image PATH for each image) and "
                             "--data DIR (answers every answer turn of its --split)")
        if data is None and (self.limit is not None or self.output is not None):
            raise UsageError("--limit and --output go with --data DIR")
        if data is not None and (self.images or self.system):
            raise UsageError("--image and --system go with --prompt (a dataset brings its own)")
        if self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.limit is not None and self.limit < 1:
            raise UsageError(f"--limit must be at least 1, got {self.limit}")
        for image in self.images:
            if not Path(image).is_file():
                raise UsageError(f"--image {image}: " + ("a directory, not an image file" if Path(image).is_dir()
                                                         else "no such file"))
        if self.output is not None:
            check_output_file("--output", self.output)
        self.sampling.validate()

    def prompts(self, data: Path | None) -> tuple[list, int]:
        """(the prompts, samples of the dataset without an answer turn)."""
        if data is None:
            return [from_text(self.prompt, self.images, self.system)], 0
        return from_dataset(data, self.split, self.limit)


def generate_config(config: RunConfig) -> RunConfig:
    """The run options `mimo generate` means: the checkpoint's weights only, one sample at a time."""
    c = config.checkpoint
    lora = config.adapters.enabled and c.load  # a LoRA checkpoint: its adapters load over --pretrained, the base
    if c.load and c.pretrained and not lora:
        raise UsageError("mimo generate: give one of --load CKPT and --pretrained PATH")
    if not (c.load or c.pretrained):
        raise UsageError("mimo generate needs --load CKPT (a mimo checkpoint) or --pretrained PATH (a mimo "
                         "checkpoint or a Hugging Face folder)")
    if c.load:
        require_checkpoint(c.load)
    return dataclasses.replace(
        config, checkpoint=(dataclasses.replace(c, **NO_SAVING, load_optim=False, load_rng=False,
                                                load_scheduler=False)
                            if lora else dataclasses.replace(c, load=None, pretrained=c.load or c.pretrained,
                                                             **NO_SAVING)),
        training=dataclasses.replace(config.training, micro_batch_size=1, global_batch_size=None,
                                     num_microbatches=None, train_iters=1, train_samples=None))


@contextlib.contextmanager
def checked_plan(config: RunConfig, request: GenerateRequest):
    """The plan of `mimo generate`, every check made before any worker starts (one line each)."""
    request.validate(config.data.data)
    plan = prepare(generate_config(config))
    check_plan(plan, WAY_OUT)
    prompt_format_of(plan.hooks, plan.settings, plan.config.provider)
    request.prompts(config.data.data)  # an unreadable image or dataset is one line now, not in every worker
    for note in foreign_notes(config.data.data) if config.data.data else ():
        print(note, file=sys.stderr, flush=True)  # stdout carries the answers alone
    check_pretrained(plan)  # a checkpoint, or Hugging Face folders that fit the provider's maps
    yield plan


def generate(plan: Plan, request: GenerateRequest) -> None:
    """Run in every process of the world: build, load, answer; world rank 0 writes."""
    config = plan.config
    try:
        world = join(plan)
        model = world.build_model()
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the answers alone
            Checkpointer(config.checkpoint, model=model, topology=world.topology,
                         run_info=run_info(plan, plan.settings, False), load_hf=hf_loader(plan, model)).load()
        fmt = prompt_format_of(plan.hooks, plan.settings, config.provider)
        prompts, without_answer = request.prompts(config.data.data)
        decoder = Decoder(model, device=world.device, params_dtype=world.params_dtype)
        answers = answer_all(decoder, fmt, prompts, sampler=Sampler(request.sampling, world.device),
                             max_new_tokens=request.max_new_tokens)
        writes = dist.get_rank() == 0
        if config.data.data is None:
            answer = next(answers)
            if writes:
                _write_one(answer, request.as_json)
        else:
            _write_all(answers, request, config.data.data, without_answer, writes)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _write_one(answer, as_json: bool) -> None:
    if not as_json:
        print(answer.text, flush=True)
        return
    g = answer.generated
    print(json.dumps({"prompt": answer.prompt.question, "answer": answer.text, "tokens": g.tokens,
                      "prompt_tokens": answer.encoded.num_tokens, "answer_tokens": len(g.tokens), "stop": g.stop,
                      "prefill_seconds": round(g.prefill_seconds, 6),
                      "decode_tokens_per_second": g.decode_tokens_per_second}), flush=True)


def _write_all(answers, request: GenerateRequest, data: Path, without_answer: int, writes: bool) -> None:
    records = []
    with (open(request.output, "w") if writes and request.output else contextlib.nullcontext(sys.stdout)) as out:
        for answer in answers:
            records.append(answer.record())
            if writes:
                out.write(json.dumps(records[-1]) + "\n")
                out.flush()
    if writes:
        skipped = f" | {counted(without_answer, 'sample')} without an answer turn" if without_answer else ""
        print(f"mimo generate: {counted(len(records), 'answer')} to {data} ({request.split}) | exact match "
              f"{mean(r['exact_match'] for r in records):.3f} | token F1 {mean(r['token_f1'] for r in records):.3f}"
              f"{skipped}", file=sys.stderr, flush=True)
