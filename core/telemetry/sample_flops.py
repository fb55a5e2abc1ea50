"""One sample's forward FLOPs for the data's counts (`DataContext.sample_flops`), from the provider's `sample_flops`
hook summed over its modules. The loader counts every sample it trains in the training process, and a dataset's
images vary in size, so the parts are asked for apart and kept: the sample's tokens (no images) and each image (no
tokens), whose sum the hookspec says is the sample's (MimoModel encodes each image alone, the LLM runs over the
tokens). A part costs the hook's call once, then a look-up."""

from __future__ import annotations

__all__ = ["SampleFlops"]

_KEPT = 1 << 16  # parts kept before the table starts over


class SampleFlops:
    """`(tokens, image_patches) -> forward FLOPs` of one sample, or None when the provider has no `sample_flops`
    (the run's TFLOP/s then count `model_flops` per row)."""

    def __init__(self, hooks, settings):
        self.hooks, self.settings = hooks, settings
        self.missing = False
        self._known: dict[tuple, float] = {}

    def __call__(self, tokens: int, image_patches) -> float | None:
        total = self._part(int(tokens), ())
        for patches in image_patches:
            if total is None:
                break
            total += self._part(0, (int(patches),))
        return total

    def _part(self, tokens: int, patches: tuple) -> float | None:
        key = (tokens, patches)
        known = self._known.get(key)
        if known is not None or self.missing:
            return known
        result = self.hooks.sample_flops(settings=self.settings, tokens=tokens, image_patches=list(patches))
        if result is None:
            self.missing = True
            return None
        value = float(sum(result.values())) if isinstance(result, dict) else float(result)
        if len(self._known) >= _KEPT:
            self._known.clear()
        self._known[key] = value
        return value
