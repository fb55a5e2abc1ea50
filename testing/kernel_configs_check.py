"""`kernel_configs` (optional): the Triton autotune tables a provider ships must have the form mimo's compile cache
records (mimo.core.run.kernel_tuning), and each kernel they name must be in a module the provider declares, or a
GPU run would pin nothing from them without saying why."""

from __future__ import annotations

from mimo.plugins import KernelConfigs

from .report import ContractError
from .subject import Subject, hookspec_signatures

HOOK = "kernel_configs"


def check_kernel_configs(subject: Subject) -> str | None:
    """Call `kernel_configs` if the hookspec exists and check the modules and each table's form. Returns a note or
    None."""
    if HOOK not in hookspec_signatures():
        return None
    returned = subject.call(HOOK, settings=subject.settings)
    if returned is None:
        return None
    if not isinstance(returned, (list, KernelConfigs)):
        raise ContractError(HOOK, f"must return a mimo.plugins.KernelConfigs (or a list of tables), got "
                                  f"{type(returned).__name__}")
    provided = KernelConfigs.of(returned)
    if not (isinstance(provided.modules, (tuple, list)) and all(isinstance(m, str) for m in provided.modules)):
        raise ContractError(HOOK, "KernelConfigs.modules must be the modules' dotted names, e.g. "
                                  "'mamba_ssm.ops.triton.ssd_bmm'")
    for table in provided.tables:
        if not (isinstance(table, dict) and isinstance(table.get("gpu"), str)
                and isinstance(table.get("kernels"), dict)):
            raise ContractError(HOOK, "each table needs 'gpu' (the GPU's name) and 'kernels' ({kernel: rows})")
        for kernel, rows in table["kernels"].items():
            if kernel.rsplit(".", 1)[0] not in provided.modules:
                raise ContractError(HOOK, f"{kernel}: its module is not among KernelConfigs.modules, so no run "
                                          f"would pin it: add '{kernel.rsplit('.', 1)[0]}'")
            for row in rows if isinstance(rows, list) else [None]:
                if not (isinstance(row, dict) and isinstance(row.get("key"), list)
                        and isinstance((row.get("config") or {}).get("kwargs"), dict)):
                    raise ContractError(HOOK, f"{kernel}: each row needs 'key' (a list) and 'config' with "
                                              f"'kwargs' (a dict), as mimo's kernel_configs.json has them")
    return None
