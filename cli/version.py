"""`mimo --version`: mimo's version and what it runs on, the way a bug report wants it."""

from __future__ import annotations

import importlib
import platform
from importlib import metadata


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _usable(module: str, distributions: tuple[str, ...]) -> str:
    """'not installed', or the version and whether its import works here (a GPU build may not load on a CPU)."""
    version = next(filter(None, map(_version, distributions)), None)
    if version is None:
        return "not installed"
    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - any failure means the same to the user: installed, not usable
        first = (str(err).strip().splitlines() or [""])[0][:120]
        return f"{version}, installed but not usable here ({type(err).__name__}: {first})"
    return f"{version}, usable"


def report() -> list[str]:
    import torch

    cuda = (f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}"
            if torch.cuda.is_available() else f"no GPU visible (built for CUDA {torch.version.cuda})")
    return [
        f"mimo {_version('mimo') or 'unknown'}",
        f"python {platform.python_version()}",
        f"torch {torch.__version__} ({cuda})",
        f"megatron-core {_version('megatron-core') or 'not installed'}",
        f"megatron-energon {_version('megatron-energon') or 'not installed'}",
        f"transformer-engine: {_usable('transformer_engine.pytorch', ('transformer-engine', 'transformer_engine'))}",
        f"mamba-ssm: {_usable('mamba_ssm.ops.triton.ssd_combined', ('mamba-ssm', 'mamba_ssm'))}",
    ]
