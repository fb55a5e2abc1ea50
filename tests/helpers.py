"""Test helpers: run the `mimo` CLI in a subprocess, build throwaway provider distributions."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

import forked_mimo

REPO = Path(__file__).resolve().parents[1]
# `mimo data sample DIR` with these: the dataset docs/evaluation.md and docs/generation.md start from, and
# test_generation_cli trains on (conftest.py's sample_dataset runs it once per test run)
SAMPLE_ARGS = ("--num-samples", "48", "--val-shards", "1")


def run_mimo(*args: str, extra_path: list[Path] = (), timeout: int = 600, env: dict | None = None):
    """Run `mimo ARGS` in a process of its own (training enables process-wide CPU redirection and a world): forked
    from a server that has imported torch already where that changes nothing (forked_mimo.py), else a fresh
    interpreter.

    The run gets a session of its own, and whatever it leaves behind is killed when it ends: a process killed
    mid-save leaves dist_checkpointing's writer processes orphaned."""
    environment = {**os.environ, **(env or {})}
    # Tests run two at a time on two cores; one compute thread per process keeps them from fighting.
    environment.setdefault("OMP_NUM_THREADS", "1")
    if extra_path:
        environment["PYTHONPATH"] = os.pathsep.join([str(p) for p in extra_path] +
                                                    [environment.get("PYTHONPATH", "")])
    # A neutral working directory: `python -m` puts it first on sys.path, and the repository root holds build
    # metadata (mimo.egg-info) that could shadow the installed distribution's entry points.
    cwd = tempfile.gettempdir()
    with tempfile.NamedTemporaryFile("w+") as out, tempfile.NamedTemporaryFile("w+") as err:
        if forked_mimo.can_fork(list(args), environment):
            process = forked_mimo.start(list(args), environment, cwd, out.name, err.name)
            command = ["mimo", *args]
            process.join(timeout)
            code = process.exitcode
        else:
            process = subprocess.Popen([sys.executable, "-m", "mimo.cli", *args], stdout=out, stderr=err, text=True,
                                       env=environment, cwd=cwd, start_new_session=True)
            command = process.args
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if code is None:
            process.wait() if isinstance(process, subprocess.Popen) else process.join()
            raise subprocess.TimeoutExpired(command, timeout)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, code, out.read(), err.read())


def start_world(function: Callable, args: tuple, nprocs: int) -> None:
    """torch.multiprocessing.start_processes(function, args, nprocs), the processes forked from the server
    forked_mimo keeps (torch, megatron-core and mimo imported once per pytest worker) rather than spawned
    interpreters that import them each (about 5 s a process); spawned with MIMO_TEST_FRESH_PROCESSES=1, as
    forked_mimo's commands then are. `function` sets up its process group itself."""
    import torch.multiprocessing

    if os.environ.get("MIMO_TEST_FRESH_PROCESSES") == "1":
        start_method = "spawn"
    else:
        start_method = "forkserver"
        forked_mimo.context()  # the server imports what a command imports before it starts
    torch.multiprocessing.start_processes(function, args=args, nprocs=nprocs, start_method=start_method)


def _call(rank: int, function: Callable, args: tuple) -> None:
    function(*args)


def forked_call(function: Callable, args: tuple) -> None:
    """`function(*args)` in a process of its own (a world of its own, if it makes one), forked as start_world's."""
    start_world(_call, (function, args), 1)


def _torchrun_member(rank: int, nprocs: int, port: int, function: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    function(*args)


def torchrun_world(function: Callable, args: tuple, nprocs: int) -> None:
    """`function(*args)` in each of `nprocs` processes with the environment torchrun gives its ranks (RANK,
    WORLD_SIZE, MASTER_ADDR, ...: init_process_group("gloo") joins them), forked as start_world's are."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_world(_torchrun_member, (nprocs, port, function, args), nprocs)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def install_distribution(source: Path, target: Path) -> Path:
    """pip-install the distribution at `source` into the folder `target` (no deps, offline build)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, capture_output=True, text=True)
    return target


def write_distribution(root: Path, dist_name: str, module: str, entry_point: str, code: str) -> Path:
    """Write a minimal provider distribution: a pyproject with one `mimo.providers` entry point and a module."""
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{dist_name}"
        version = "1.0"
        [project.entry-points."mimo.providers"]
        {entry_point} = "{module}"
        [tool.setuptools]
        py-modules = ["{module}"]
    """))
    (root / f"{module}.py").write_text(textwrap.dedent(code))
    return root


@contextlib.contextmanager
def world_of_one():
    """A one-process gloo world on the CPU (CUDA redirected), torn down afterwards if this created it."""
    import torch.distributed as dist

    from mimo.core.run import cpu_redirect

    cpu_redirect.enable()  # megatron's RNG tracker reads "CUDA" generator state; on the CPU it is the CPU's
    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def doc_example_lines(doc) -> list[str]:
    """The non-empty lines of the first bash block under a doc's "## Example" heading."""
    text = doc.read_text().split("## Example", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def build_nemotron_encoder(settings):
    """The Nemotron provider's RADIO encoder alone (no projection), built through its build_encoders hook for a
    world of one (inside `world_of_one()`), seeded."""
    import torch
    from megatron.core.transformer.spec_utils import build_module

    from mimo.core.config import LayoutOptions
    from mimo.core.parallel import layout, topology
    from mimo.core.run.launch import seed_everything
    from mimo.plugins import BuildContext
    from mimo.providers import nemotron

    parallelism = layout.plan(LayoutOptions(), 1, nemotron.model_shape(settings), micro_batch_size=1)
    topo = topology.build(parallelism, backend="gloo")
    seed_everything(0, tp_rank=0, ep_rank=0, etp_rank=0)
    ctx = BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)
    spec = nemotron.build_encoders(settings, ctx)[nemotron.IMAGES].spec
    return build_module(spec.submodules["encoders"][nemotron.ENCODER])


def build_mimo_model(provider, settings, modality: str):
    """A MimoModel of `provider`'s (a provider module) hooks with `settings` in a world of one (world_of_one), one
    module of `modality`, fp32, in eval mode."""
    import torch
    from megatron.core.models.mimo import MimoModel, MimoModelConfig

    from mimo.core.config import LayoutOptions
    from mimo.core.parallel import layout, topology
    from mimo.core.run.launch import seed_everything
    from mimo.plugins import BuildContext

    parallelism = layout.plan(LayoutOptions(), 1, provider.model_shape(settings), micro_batch_size=1)
    topo = topology.build(parallelism, backend="gloo")
    seed_everything(0, tp_rank=0, ep_rank=0, etp_rank=0)
    ctx = BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)
    encoder = provider.build_encoders(settings, ctx)[modality]
    config = MimoModelConfig(language_model_spec=provider.build_language_model(settings, ctx),
                             modality_submodules_spec={modality: encoder.spec},
                             special_token_ids={modality: encoder.placeholder_token_id},
                             module_to_grid_map=topo.grids)
    return MimoModel(config).eval()


def shared_artifact(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder `name`, built by `build(folder)` once per test run, whichever xdist worker asks first.

    Each xdist worker is a session of its own with its own basetemp under the run's; the artifact goes into the run's
    folder, and a file lock makes the other workers wait for it and reuse it. Tests must only read it."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    root = base / "shared"
    root.mkdir(exist_ok=True)
    done = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            partial = root / f"{name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            build(partial)
            partial.rename(done)  # complete or absent: a failed build is retried by the next test that asks
    return done


def train_steps(model, optimizer, loss_of: Callable, steps: int) -> list[float]:
    """`steps` training steps of a built MimoModel in one process: zeroed buffers, backward of `loss_of()`, each
    held module's gradient sync finished, the optimizer's step; the losses."""
    from mimo.core.parallel.model import held_modules

    losses = []
    for _ in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = loss_of()
        loss.backward()
        for _, module in held_modules(model):
            module.finish_grad_sync()
        optimizer.step()
        losses.append(loss.item())
    return losses


def relative_error(got, want) -> float:
    """max |got - want| / max |want| of two tensors: the parity tests' measure against a reference model."""
    return float((got - want).abs().max() / want.abs().max())
