"""`kernel_configs` (optional): the Triton autotune tables a provider ships must have the form mimo's compile cache
records (mimo.core.run.kernel_tuning), or a GPU run would pin nothing from them without saying why."""

from __future__ import annotations

from .report import ContractError
from .subject import Subject, hookspec_signatures

HOOK = "kernel_configs"


def check_kernel_configs(subject: Subject) -> str | None:
    """Call `kernel_configs` if the hookspec exists and check each table's form. Returns a note or None."""
    if HOOK not in hookspec_signatures():
        return None
    tables = subject.call(HOOK, settings=subject.settings)
    if tables is None:
        return None
    if not isinstance(tables, list):
        raise ContractError(HOOK, f"must return a list of tables, got {type(tables).__name__}")
    for table in tables:
        if not (isinstance(table, dict) and isinstance(table.get("gpu"), str)
                and isinstance(table.get("kernels"), dict)):
            raise ContractError(HOOK, "each table needs 'gpu' (the GPU's name) and 'kernels' ({kernel: rows})")
        for kernel, rows in table["kernels"].items():
            for row in rows if isinstance(rows, list) else [None]:
                if not (isinstance(row, dict) and isinstance(row.get("key"), list)
                        and isinstance((row.get("config") or {}).get("kwargs"), dict)):
                    raise ContractError(HOOK, f"{kernel}: each row needs 'key' (a list) and 'config' with "
                                              f"'kwargs' (a dict), as mimo's kernel_configs.json has them")
    return None
