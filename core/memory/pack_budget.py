"""How many image placeholders one packed row may carry (`--pack-image-tokens`), decided with the memory plan.

With sequence packing a row of `seq_length` tokens holds as many samples as fit, and their images with them: a
row of small captioned images carries dozens of images, so the encoders see many times the tokens of one sample's
media, which the plan used to assume. The packer (data/task_encoder.py) closes a row at either budget, the LLM's
tokens or the image placeholders; the estimate counts the encoders at the image budget times each encoder's tokens
per placeholder (`ModuleMemory.tokens_per_image_token`). So a layout the plan accepts fits every pack.

Default (auto): `seq_length` (a row's images can take no more); with --pack-scan-samples N, the image tokens of
the largest pack the dataset makes (core/run/pack_scan.py reads its first N samples through the packer; the packer
then holds every row to that); where that does not fit the GPU, the largest budget that does, at least a quarter of `seq_length`
(below that, rows of images close nearly empty; the memory check then refuses the layout with its usual advice).
Where nothing is enforced (a CPU run without --gpu-memory), `seq_length`.
"""

from __future__ import annotations

from mimo.errors import UsageError
from mimo.plugins import LANGUAGE

GRAIN = 16  # budgets are multiples of this: a few placeholders more or less do not matter, a stable value does


def resolve(plan, fits, scan=None) -> None:
    """Set `plan.pack_image_tokens`: None unless the run packs --data; `fits(plan)` is the memory check's rule;
    `scan(plan, budget)`: the packs --data makes with rows of at most `budget` image tokens (core/run/pack_scan.py),
    or None where the dataset is not read."""
    data = plan.config.data
    seq_length = getattr(plan.settings, "seq_length", None)
    plan.pack_scan = None
    if data.data is None or not data.pack_sequences or not seq_length:
        plan.pack_image_tokens = None
        return
    if data.pack_image_tokens is not None:
        if data.pack_image_tokens > seq_length:
            raise UsageError(f"--pack-image-tokens {data.pack_image_tokens} is more than a row holds (seq_length "
                             f"{seq_length}): give at most {seq_length}")
        plan.pack_image_tokens = data.pack_image_tokens
        return
    plan.pack_image_tokens = seq_length
    if not _bounded_by_memory(plan):
        return
    packs = scan(plan, seq_length, GRAIN) if scan is not None else None
    if packs is not None and packs.rows:  # the dataset's largest pack: the run's packer holds rows to it
        plan.pack_scan = packs
        plan.pack_image_tokens = min(seq_length, max(GRAIN, -(-packs.image_tokens // GRAIN) * GRAIN))
    if fits(plan):
        return
    plan.pack_scan = None  # less than the dataset's packs carry: the memory decides
    ceiling = plan.pack_image_tokens
    floor = min(ceiling, max(GRAIN, seq_length // 4 // GRAIN * GRAIN))
    plan.pack_image_tokens = floor
    if not fits(plan):
        return  # the memory check says what would help
    low, high = floor, ceiling  # fits at low, not at high
    while high - low > GRAIN:
        middle = (low + high) // 2 // GRAIN * GRAIN
        plan.pack_image_tokens = middle
        low, high = (middle, high) if fits(plan) else (low, middle)
    plan.pack_image_tokens = low


def _bounded_by_memory(plan) -> bool:
    """Whether an encoder's estimate follows the image budget (its provider says its tokens per placeholder)."""
    described = plan.hooks.module_memory(settings=plan.settings) or {}
    return any(m.tokens_per_image_token and m.tokens_per_sample for name, m in described.items() if name != LANGUAGE)


def describe(plan) -> str | None:
    """The plan's line on packing, or None when the run does not pack --data."""
    if plan.pack_image_tokens is None:
        return None
    how = "--pack-image-tokens" if plan.config.data.pack_image_tokens is not None else \
        plan.pack_scan.line() if plan.pack_scan is not None else \
        "the most that fits" if plan.pack_image_tokens < plan.settings.seq_length else "a whole row"
    return (f"packs: rows of {plan.settings.seq_length} tokens with at most {plan.pack_image_tokens} image tokens "
            f"({how})")
