"""One GPU: what megatron-core's all-to-all dispatcher costs beside its all-to-all (issue 48's expert parallelism).

With one rank of experts mimo's MoE layers keep the token counts on the GPU and skip the chunk sort
(`DeviceCountsMoELayer`, plugins/kit/grouped_mm_moe.py). Under expert parallelism they cannot: megatron-core's
dispatcher copies the counts to the host, waits for them once per MoE layer and micro-batch, and sorts the received
chunks by expert. This runs `mimo ARGS` in this process (one GPU: no workers) with the dispatcher left as
megatron-core builds it, so that a run beside the plain one, in the same call and on the same data, measures that
part of expert parallelism's price on one GPU: what is left of it on two is the all-to-all itself.

    python scripts/gpu/dispatch_paths.py host run --device cuda --provider ...     # megatron-core's dispatcher
    python scripts/gpu/dispatch_paths.py device run --device cuda --provider ...   # mimo's, as `mimo run` does
    python scripts/gpu/dispatch_paths.py compare A.jsonl B.jsonl [--skip N]          # ms an iteration, pair by pair
"""

from __future__ import annotations

import atexit
import collections
import json
import statistics
import sys


def compare(first: str, second: str, skip: int) -> None:
    def times(path):
        return {r["iteration"]: r["elapsed_ms"] for r in map(json.loads, open(path)) if r["iteration"] > skip}

    a, b = times(first), times(second)
    common = sorted(set(a) & set(b))
    if not common:
        sys.exit(f"no iteration after {skip} in both {first} and {second}")
    differences = [b[i] - a[i] for i in common]
    for name, t in ((first, a), (second, b)):
        values = [t[i] for i in common]
        print(f"{name}: ms/iteration {min(values):.0f}-{statistics.median(values):.0f}-{max(values):.0f}")
    print(f"second - first over iterations {common[0]}-{common[-1]}: median {statistics.median(differences):+.1f} ms"
          f" (min {min(differences):+.1f}, max {max(differences):+.1f})")


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("host", "device", "compare"):
        sys.exit(__doc__.split("\n\n")[-1])
    if argv[0] == "compare":
        skip = int(argv[argv.index("--skip") + 1]) if "--skip" in argv else 4
        compare(argv[1], argv[2], skip)
        return
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mimo.core.run.forked_workers import run_cli
    from mimo.plugins.kit import grouped_mm_moe

    layer = grouped_mm_moe.DeviceCountsMoELayer
    # "host": the layer as megatron-core builds it, its dispatcher unchanged (counts to the host, chunks sorted)
    build = MoELayer.__init__ if argv[0] == "host" else layer.__init__
    dispatchers = collections.Counter()

    def counted(self, *args, **kwargs):
        build(self, *args, **kwargs)
        dispatchers[type(self.token_dispatcher).__name__] += 1

    layer.__init__ = counted
    atexit.register(lambda: print(f"dispatch_paths {argv[0]}: MoE layers' dispatchers {dict(dispatchers)}"))

    sys.exit(run_cli(argv[1:]))


if __name__ == "__main__":
    main(sys.argv[1:])
