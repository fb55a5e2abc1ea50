"""What the workers of a CPU run import, done once in the launcher they are forked from (core/run/forked_workers.py),
and in the tests' command server (tests/forked_mimo.py).

The console's routing comes first (from the environment: --verbose, --log-file), so the libraries' import-time
notices go where a command's own would. Then torch's heavy parts, megatron-core, energon,
mimo's training, evaluation and generation modules and the installed providers: a worker finds them imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata

from mimo.plugins.manager import ENTRY_POINT_GROUP

from . import console

console.configure()

for _module in ("torch", "torch.distributed.tensor", "torch._dynamo", "torch._inductor.compile_fx", "megatron.core",
                "megatron.energon", "mimo.core.run.loop", "mimo.core.run.evaluate", "mimo.core.run.generate",
                "mimo.cli.main"):
    importlib.import_module(_module)

for _entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
    try:
        _entry_point.load()
    except Exception:  # noqa: BLE001 - the worker that loads it says what is wrong, as without this server
        pass
