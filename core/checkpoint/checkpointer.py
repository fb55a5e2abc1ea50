"""Save and load one run's state through megatron-core's dist_checkpointing (torch_dist), collectively.

Every rank writes its shards; only then, after a barrier, rank 0 writes checksums.json, run.yaml and last common.pt
(a checkpoint's completion record, save_dir.py), then replaces the tracker (layout.py). A save never writes into the
folder of a complete checkpoint: one of another run (`--start-anew`) is kept and the save skipped with one line. Model, optimizer, per-module RNG and per-lane data state are sharded objects, so a checkpoint loads
into another layout (another DP size; colocated <-> heterogeneous) wherever the state allows it.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from mimo.errors import UsageError

from . import adapter_state, checksums
from .foreign import foreign_directory
from .layout import (
    COMMON, RUN_FILE, TRACKER, VERSION, atomic_write, fault_point, iteration_dir, read_common, read_tracker, report_io,
)
from .save_dir import prune
from .match import check_kept_options, check_model_fits
from .state import (
    allocate_optimizer_state, merge_common, own_common, rng_state, set_rng_state, unshare_adam_steps,
)
from ..config import CheckpointOptions
from ..parallel.model import parameters_gathered
from ..parallel.topology import LANGUAGE, Topology

EXTRA_STATE = "_extra_state"


class Checkpointer:
    """Saves and loads one run's state. Every method is collective over the world."""

    def __init__(self, options: CheckpointOptions, *, model, topology: Topology, run_info: dict, optimizer=None,
                 scheduler=None, data_state=lambda: {"loader": None}, load_foreign=None, load_hf=None):
        """`optimizer` and `scheduler` None: weights only. `data_state()` is this lane's data state to save;
        `load_foreign(path, directory)` loads a --pretrained format the provider reads itself; `load_hf()` the
        run's Hugging Face folders (hf_load.hf_loader: None when there are none)."""
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        self.options, self.model, self.optimizer, self.scheduler = options, model, optimizer, scheduler
        self.topology, self.run_info, self.data_state_fn = topology, run_info, data_state
        self.load_foreign = load_foreign  # (path, directory): a --pretrained format the provider reads itself
        self.load_hf = load_hf  # () -> None: --pretrained HF_DIR, --pretrained-llm, --pretrained-vision
        # One strategy for the whole run: with cached_metadata it reuses the first save's plan.
        self.strategy = TorchDistSaveShardedStrategy(cached_metadata=options.ckpt_assume_constant_structure)
        self.last_saved: Path | None = None  # the newest checkpoint this run committed
        self.report_saves = True  # a "saved checkpoint" line per save (not for a conversion's scratch copy)
        self.async_queue = None
        # --lora-rank: checkpoints hold the adapters alone, and name the base they were trained on
        options_saved = run_info.get("options", {})
        self.lora = bool(options_saved.get("adapters", {}).get("lora_rank"))
        self.seed = options_saved.get("training", {}).get("seed")
        self.adapter_base: dict | None = None  # that base, once known (a resume keeps the one it loaded)
        self.series: str | None = None  # the run this one continues (save_dir.py); set by load() or the first save
        self.series_known = False
        if options.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.async_queue = AsyncCallsQueue()

    # ---- saving ----

    def save(self, iteration: int, consumed_samples: int) -> bool:
        """Save `iteration`; False (and one line) when its folder holds a complete checkpoint already, which a save
        never replaces (another run's, kept with --start-anew: the start-up check refuses scheduled saves onto one,
        so only a stop's save can meet it)."""
        from megatron.core import dist_checkpointing

        blocked_since = time.perf_counter()
        if self.async_queue is not None:
            self.async_queue.maybe_finalize_async_calls(blocking=True)  # one save in flight at a time
        self._save_started = time.perf_counter()
        self._begin_series()
        directory = iteration_dir(self.options.save, iteration)
        if _agreed(directory.is_dir() and (directory / COMMON).is_file()):  # every rank takes the same branch
            if dist.get_rank() == 0:
                print(f"not saved: {directory} holds a complete checkpoint of another run, which is never replaced",
                      flush=True)
            return False
        if dist.get_rank() == 0:
            if directory.exists():  # a save cut short before its common.pt: never a complete checkpoint
                shutil.rmtree(directory)
            directory.mkdir(parents=True)
        dist.barrier()
        fault_point("before-shards", iteration)
        with parameters_gathered(self.model):
            state = self._sharded_state(loading=False, optimizer=self.options.save_optim,
                                        rng=self.options.save_rng)
        state.update(self._common(iteration, consumed_samples))
        background = {"async_sharded_save": True, "async_strategy": "mcore"} if self.async_queue else {}
        request = dist_checkpointing.save(state, str(directory), sharded_strategy=self.strategy, **background)
        if request is None:
            self._commit(iteration, state)
        else:
            request.finalize_fns.append(lambda: self._commit(iteration, state))
            self.async_queue.schedule_async_request(request)  # copies the state to host memory, hands it over
            # What training waited for: a previous save still being written, then this one's hand-off.
            self._save_blocked = time.perf_counter() - blocked_since
        return True

    def _begin_series(self, series: str | None = None, continued: bool = False) -> None:
        """The series this run's checkpoints belong to: the loaded checkpoint's (`continued`), else a new one, the
        same on every rank (rank 0's). Collective the first time."""
        if self.series_known:
            return
        if not continued:
            chosen = [uuid.uuid4().hex[:16]]
            dist.broadcast_object_list(chosen, src=0)
            series = chosen[0]
        self.series, self.series_known = series, True

    def wait(self, blocking: bool = True) -> None:
        """Finish background saves (blocking), or only those already written (not blocking)."""
        if self.async_queue is not None:
            self.async_queue.maybe_finalize_async_calls(blocking=blocking)

    def _commit(self, iteration: int, state: dict) -> None:
        """After every rank has written: common.pt, then the tracker (atomically), then pruning."""
        from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base

        fault_point("after-shards", iteration)
        sums = checksums.gather(iteration_dir(self.options.save, iteration))  # collective, after every write
        if dist.get_rank() == 0:
            root = Path(self.options.save)
            checksums.write(iteration_dir(root, iteration), sums, atomic_write)
            if self.run_info.get("run_file"):  # the run as `mimo run --config` reads it
                text = self.run_info["run_file"].encode()
                atomic_write(iteration_dir(root, iteration) / RUN_FILE, lambda f: f.write(text))
            # Last, the completion record: what megatron-core's own (legacy) readers load from common.pt, every
            # non-sharded entry.
            common = extract_sharded_base(extract_nonpersistent(state)[1])[1]
            atomic_write(iteration_dir(root, iteration) / COMMON, lambda f: torch.save(common, f))
            fault_point("before-tracker", iteration)
            atomic_write(root / TRACKER, lambda f: f.write(f"{iteration}\n".encode()))
            if self.options.keep_last:
                prune(root, self.options.keep_last, self.series, saved=iteration)
            if self.report_saves:
                report_io("saved", iteration_dir(root, iteration), time.perf_counter() - self._save_started,
                          blocked=self._save_blocked if self.async_queue is not None else None)
        dist.barrier()
        self.last_saved = iteration_dir(self.options.save, iteration)

    def _common(self, iteration: int, consumed_samples: int) -> dict:
        scheduler_state = None  # a weights-only checkpointer (no optimizer, no schedule: mimo ckpt import-hf)
        if self.scheduler is not None:
            scheduler_state = self.scheduler.state_dict()
            # megatron-core's scheduler leaves its WSD fields out of state_dict()
            scheduler_state.update(wsd_decay_steps=self.scheduler.wsd_decay_steps,
                                   lr_wsd_decay_style=self.scheduler.lr_wsd_decay_style)
        return {
            "checkpoint_version": VERSION,
            "series": self.series,  # the run this checkpoint continues (save_dir.py)
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "opt_param_scheduler": scheduler_state,
            "run": self.run_info,
            "adapters": self._adapter_base() if self.lora else None,
            "contents": {"optimizer": self.options.save_optim, "rng": self.options.save_rng, "adapters": self.lora,
                         "optimizer_sharding": self._optimizer_sharding(),
                         "distributed_optimizer": self.optimizer is not None and
                                                  self.optimizer.config.use_distributed_optimizer},
        }

    def _adapter_base(self) -> dict:
        if self.adapter_base is None:
            self.adapter_base = adapter_state.base_record(self.options, self.seed)
        return self.adapter_base

    def _model_state(self, part: str | None = None) -> dict:
        """This rank's sharded model state; of a LoRA run, `part` (adapter_state.BASE or ADAPTERS) alone."""
        return adapter_state.model_part(self.model.sharded_state_dict(), part if self.lora else None)

    def _optimizer_sharding(self) -> str:
        return "fully_reshardable" if self.options.dist_ckpt_optim_fully_reshardable else "dp_reshardable"

    def _sharded_state(self, loading: bool, optimizer: bool, rng: bool, sharding: str | None = None) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        model_state = self._model_state(adapter_state.ADAPTERS)
        state = {"model": model_state}
        held = self.topology.pg_collections
        if optimizer and loading:
            allocate_optimizer_state(self.optimizer)
        if optimizer:
            sharding = sharding or self._optimizer_sharding()
            optimizer_state = self.optimizer.sharded_state_dict(
                model_state, is_loading=loading, metadata={"distrib_optim_sharding_type": sharding})
            # Only the modules this rank holds: MimoOptimizer gives the others an empty dict, which would enter the
            # common state of some ranks and not others (megatron-core then warns that it differs across ranks).
            state["optimizer"] = {name: own_common(sub, f"optimizer.{name}", held[name])
                                  for name, sub in optimizer_state.items() if name in held}
        if rng:
            payload = rng_state()
            state["rng_state"] = {
                name: ShardedObject(f"rng_state.{name}", payload, (pgc.pp.size(), pgc.tp.size()),
                                    (pgc.pp.rank(), pgc.tp.rank()), replica_id=(pgc.dp.rank(), pgc.cp.rank()))
                for name, pgc in held.items()
            }
        if LANGUAGE in held:  # one data state per LLM lane, with the number of lanes it was saved under
            pgc = held[LANGUAGE]
            state["data_state"] = ShardedObject(
                "data_state", self.data_state_fn(), (pgc.dp.size(),), (pgc.dp.rank(),),
                replica_id=(pgc.tp.rank(), pgc.pp.rank(), pgc.cp.rank()))
        return state

    # ---- loading ----

    def load(self) -> tuple[int, int, dict | None]:
        """Restore what the options say; return (iteration, consumed samples, this lane's saved data state)."""
        started = time.perf_counter()
        result = self._load()
        self._begin_series()  # a fresh start or --finetune: a new series (a resume took the checkpoint's)
        if result[0] and dist.get_rank() == 0:
            report_io("loaded", iteration_dir(self.options.load, result[0]), time.perf_counter() - started)
        return result

    def _load(self) -> tuple[int, int, dict | None]:
        opts = self.options
        iteration = read_tracker(opts.load) if opts.load else None
        if iteration is None:
            if opts.load and opts.finetune:
                raise UsageError(f"--finetune: no checkpoint in {opts.load} ({TRACKER} is missing)")
            self._load_base()
            return 0, 0, None
        directory = iteration_dir(opts.load, iteration)
        if not directory.is_dir():
            raise UsageError(f"{Path(opts.load) / TRACKER} names iteration {iteration}, but {directory} is missing")
        common = read_common(directory)
        adapter_state.check_saved(common["contents"].get("adapters", False), self.lora, directory, "--load")
        if self.lora:  # the base the adapters were trained on, then the adapters
            adapter_state.check_base(common["adapters"], opts, self.seed, directory)
            self.adapter_base = common["adapters"]
            self._load_base(resuming=True)
        self._check_compatible(common, directory)
        if opts.finetune:
            self._load_weights_only(opts.load, what="--finetune", common=common)
            return 0, 0, None
        self._begin_series(common.get("series"), continued=True)  # None: a checkpoint of an older mimo

        load_optim = common["contents"]["optimizer"] and opts.load_optim
        if not common["contents"]["optimizer"] and opts.load_optim and dist.get_rank() == 0:
            print(f"warning: {directory} holds no optimizer state (saved with --no-save-optim): loading the "
                  f"weights and starting a fresh optimizer", flush=True)
        if load_optim:
            check_kept_options(common["run"].get("options"), self.run_info["options"], directory)
            self._check_optimizer_resharding(common)
        load_rng = common["contents"]["rng"] and opts.load_rng
        if load_rng and (reshaped := self.topology.layout.rng_resharding(common["run"]["layout"])):
            load_rng = False  # a layout of other TP or PP sizes (the weights and optimizer state reshard)
            if dist.get_rank() == 0:
                print(f"note: {reshaped}", flush=True)
        saved_lanes = common["run"]["layout"][LANGUAGE]["dp"]
        lanes = self.topology.layout.lanes
        # Distributed-optimizer state loads in the format it was saved in.
        state = self._sharded_state(loading=True, optimizer=load_optim, rng=load_rng,
                                    sharding=common["contents"]["optimizer_sharding"])
        if saved_lanes != lanes:
            state.pop("data_state", None)  # saved per lane: it cannot be split or merged
        loaded = self._dist_load(state, directory)
        self._load_model(loaded["model"], adapter_state.ADAPTERS)
        if load_optim:
            with torch.no_grad():  # megatron-core's dp_reshardable loader copies into parameters without it
                self.optimizer.load_state_dict({n: merge_common(sub) for n, sub in loaded["optimizer"].items()})
            unshare_adam_steps(self.optimizer)
        else:
            self._refresh_main_params()
        if opts.load_scheduler and common["opt_param_scheduler"] is not None:
            self._load_scheduler(common["opt_param_scheduler"])
        if load_rng:
            set_rng_state(next(iter(loaded["rng_state"].values())))
        if saved_lanes != lanes and common["run"]["lane_data_state"]:
            raise UsageError(f"the checkpoint's data state was saved for {saved_lanes} LLM data-parallel lanes, "
                             f"this run has {lanes}: resume with the same layout, or pass --finetune")
        return iteration, common["consumed_samples"], loaded.get("data_state")

    def _load_base(self, resuming: bool = False) -> None:
        """The run's initial weights: its Hugging Face folders or --pretrained (of a LoRA run: the base; `resuming`:
        the adapters' checkpoint restores optimizer, schedule and data next)."""
        if self.load_hf is not None:  # Hugging Face folders: each rank reads its slices
            self.load_hf()
            self._refresh_main_params()
        elif self.options.pretrained:
            self._load_pretrained(self.options.pretrained, resuming)

    def _check_optimizer_resharding(self, common: dict) -> None:
        """Distributed-optimizer state saved per DP shard (dp_reshardable) loads only at the same DP size."""
        contents = common["contents"]
        if contents["distributed_optimizer"] != self.optimizer.config.use_distributed_optimizer:
            raise UsageError("the checkpoint's optimizer state was saved "
                             f"{'with' if contents['distributed_optimizer'] else 'without'} "
                             "--use-distributed-optimizer: resume the same way, or pass --no-load-optim")
        if not contents["distributed_optimizer"] or contents["optimizer_sharding"] != "dp_reshardable":
            return
        saved_dp = {name: saved["dp"] for name, saved in common["run"]["layout"].items()}
        if changed := self.topology.layout.optimizer_resharding(saved_dp):
            name, saved, now = changed
            raise UsageError(f"the checkpoint's distributed-optimizer state is sharded for {name} DP {saved}, "
                             f"this run has DP {now}: resume at DP {saved}, or pass --no-load-optim (save "
                             f"with --dist-ckpt-optim-fully-reshardable to reshard later)")

    def _load_pretrained(self, path: Path, resuming: bool = False) -> None:
        anew = "" if resuming else "; optimizer, schedule and data start anew"
        directory = foreign_directory(path)
        if directory is None:
            self._load_weights_only(path, what="--pretrained", fresh=not resuming)
        elif self.load_foreign is None:
            raise UsageError(f"--pretrained {path} is not a mimo checkpoint")
        else:
            self.load_foreign(path, directory)
            self._refresh_main_params()
            if dist.get_rank() == 0:
                print(f"loaded weights from {directory} (a dist checkpoint the provider's load_pretrained read)"
                      f"{anew}", flush=True)

    def _load_weights_only(self, root: Path, what: str, common: dict | None = None, fresh: bool = True) -> None:
        iteration = read_tracker(root)
        if iteration is None:
            raise UsageError(f"{what} {root}: no checkpoint there ({TRACKER} is missing)")
        directory = iteration_dir(root, iteration)
        common = common or read_common(directory)
        saved_adapters = common["contents"].get("adapters", False)
        adapter_state.check_saved(saved_adapters, self.lora and what != "--pretrained", directory, what)
        part = adapter_state.ADAPTERS if saved_adapters else adapter_state.BASE
        self._check_compatible(common, directory, part)
        model_state = self._model_state(part)
        started = time.perf_counter()
        self._load_model(self._dist_load({"model": model_state}, directory)["model"], part)
        self._refresh_main_params()
        if dist.get_rank() == 0:
            origin = f"{directory} (saved at iteration {iteration} by provider {common['run']['provider']})"
            anew = "; optimizer, schedule and data start anew" if fresh and self.optimizer is not None else ""
            print(f"loaded weights from {origin} in {time.perf_counter() - started:.2f} s{anew}", flush=True)

    def _load_model(self, state: dict, part: str) -> None:
        """Strict, but for `_extra_state` entries the checkpoint did not have (see _dist_load) and, in a LoRA run,
        the tensors of the other part (base or adapters) than `part`."""
        result = self.model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith(EXTRA_STATE) and
                   adapter_state.model_part({k: None}, part if self.lora else None)]
        if missing or result.unexpected_keys:  # cannot happen when the request came from this model
            raise RuntimeError(f"model state mismatch: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")

    def _refresh_main_params(self) -> None:
        """bf16 optimizers keep fp32 main copies of the weights, taken when they were built: after loading weights
        without optimizer state, give them the weights loaded, or the first step would go on from the initial
        ones. Never when the optimizer state loads: it holds the saved main copies (read in place by the load)."""
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def _dist_load(self, state: dict, directory: Path) -> dict:
        from torch.distributed.checkpoint.api import CheckpointException

        from mimo.plugins.kit import dist_checkpoint

        _verify_files(directory)
        checksums.verify(directory)
        try:
            loaded, absent = dist_checkpoint.load(state, directory)
        # Whatever the libraries raise, the user gets one line naming it. torch's CheckpointException derives from
        # BaseException, not Exception, so it is named apart.
        except (Exception, CheckpointException) as err:  # noqa: BLE001
            if isinstance(err, CheckpointException) and err.failures:  # torch wraps each rank's error
                err = next(iter(err.failures.values()))[0]  # (exception, traceback summary)
            text = str(err).strip()
            first = f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
            raise UsageError(f"checkpoint {directory} cannot be loaded ({first[:400]})") from None
        # A key the model needs that the checkpoint lacks is an error; extra keys in the checkpoint are fine.
        # transformer-engine modules keep FP8 metadata as `_extra_state`, which a checkpoint of local modules (or
        # a Hugging Face import) lacks: nothing to restore, the modules keep their fresh one.
        absent = {key for key in absent if not key.split("/")[0].endswith(EXTRA_STATE)}
        # Every rank must agree before one of them stops: the others would wait in the next collective.
        any_absent = torch.tensor([len(absent)], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(any_absent, op=dist.ReduceOp.MAX)
        if any_absent.item():
            named = f", e.g. {', '.join(repr(k) for k in sorted(absent)[:3])}" if absent else " (on another rank)"
            raise UsageError(f"checkpoint {directory} lacks state this run needs{named}")
        return loaded

    def _check_compatible(self, common: dict, directory: Path, part: str = adapter_state.ADAPTERS) -> None:
        if common.get("checkpoint_version") != VERSION:
            raise UsageError(f"{directory} has checkpoint version {common.get('checkpoint_version')}, "
                             f"this mimo reads version {VERSION}")
        saved = common["run"]["provider"]
        if saved != self.run_info["provider"]:
            raise UsageError(f"{directory} was saved by provider '{saved}', this run uses "
                             f"'{self.run_info['provider']}'")
        # Settings and tensor shapes against this run's model, from the metadata, before any tensor is read.
        what = "--pretrained" if self.options.pretrained and Path(directory).parent == Path(self.options.pretrained) \
            else "--load"
        check_model_fits(self.model, common["run"]["settings"], self.run_info["settings"], directory, what,
                         state=self._model_state(part))

    def _load_scheduler(self, saved: dict) -> None:
        # A constant schedule has no length: a run resumed with a larger --train-iters continues it unchanged, so
        # megatron-core's check that the lengths match would only refuse an equivalent schedule.
        saved, sched = dict(saved), self.scheduler
        if saved.get("lr_decay_style") == sched.lr_decay_style == "constant":
            saved["lr_decay_steps"] = sched.lr_decay_steps
        if saved.get("wd_incr_style") == sched.wd_incr_style == "constant":
            saved["wd_incr_steps"] = sched.wd_incr_steps
        try:
            sched.load_state_dict(saved)
        except AssertionError as err:
            raise UsageError(f"the learning-rate schedule differs from the checkpoint's ({err}); pass "
                             f"--no-load-scheduler to start this run's schedule from the checkpoint's weights") from None


def _verify_files(directory: Path) -> None:
    """Name a missing or truncated shard before loading: torch's reader would only say EOFError."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(directory)).read_metadata().storage_data
    except Exception as err:  # noqa: BLE001 - unreadable metadata, whatever the cause
        raise UsageError(f"checkpoint file {directory / '.metadata'} cannot be read ({type(err).__name__})") from None
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            raise UsageError(f"checkpoint file {path} is missing")
        if path.stat().st_size < size:
            raise UsageError(f"checkpoint file {path} is truncated ({path.stat().st_size} of {size} bytes)")


def _collective_device() -> torch.device:
    """Where the world's collectives run: the GPU under NCCL, the CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")




def _agreed(flag: bool) -> bool:
    """Whether any rank found `flag` (one small all-reduce), so that every rank takes the same branch."""
    value = torch.tensor([int(flag)], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
