"""Seconds to build a provider's model with its initial weights drawn on the CPU, at several intra-op thread
counts (what core/parallel/model.py's `init_threads` gives a GPU run's ranks): one fresh process of one rank per
count, the counts in turn, on the local backend.

    python bench/model_build.py --provider nemotron-moe-vlm-52l --set 'hybrid_pattern=MEMEM*EMEM' --threads 1 2
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--provider", default="nemotron-moe-vlm-52l")
    parser.add_argument("--set", action="append", default=[], help="a provider setting")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    import torch.distributed as dist

    from mimo.core.config import RunConfig, TrainingOptions
    from mimo.core.run.plan import prepare
    from mimo.core.run.world import join

    if len(args.threads) > 1:  # a process per count: a built model's memory is not all handed back
        import os
        import subprocess
        import sys

        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29561", "RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_WORLD_SIZE": "1"}
        for threads in args.threads:
            sets = [a for s in args.set for a in ("--set", s)]
            subprocess.run([sys.executable, __file__, "--provider", args.provider, *sets, "--threads", str(threads)],
                           env=env, check=True)
        return
    plan = prepare(RunConfig(provider=args.provider, provider_settings=["backend=local", *args.set],
                             training=TrainingOptions(device="cpu", precision="bf16", micro_batch_size=1)),
                   world_size=1)
    world = join(plan)
    torch.set_num_threads(args.threads[0])
    start = time.perf_counter()
    model = world.build_model()
    seconds = time.perf_counter() - start
    count = sum(p.numel() for p in model.parameters())
    print(f"{args.threads[0]} thread(s): {seconds:.1f} s to build {count / 1e9:.2f}B parameters", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
