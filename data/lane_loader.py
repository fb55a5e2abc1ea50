"""The lane loader: megatron-energon data for the LLM data-parallel lanes one rank reads, one micro-batch at a time.

Which samples. LLM lane `j` of `L` is energon data-parallel rank `j` of `L` with `W` workers: energon splits the
dataset over the `L x W` global workers and derives each worker's shard and shuffle seed from its global worker id
and the seed alone, and a lane's stream is its workers' samples in turn. A rank that reads `k` lanes (an encoder
rank feeding `k` LLM lanes) builds one loader as energon rank `first_lane / k` of `L / k` with `k x W` workers:
the very same global workers. Each sample carries its global worker id in its restore key, so routing it to
that worker's queue, and letting each lane take from its own workers in turn, gives every lane exactly the stream
a loader of its own would give. Every rank that reads a lane (its LLM TP/PP ranks, the encoder ranks feeding it)
therefore sees the same samples in the same order. Without worker processes (`W = 0`) each lane gets an
in-process loader of its own (energon treats it as one worker). The streams depend on `L x W` (energon's global
worker count) and the seed, not on how the encoders are laid out.

Batches. Workers decode and encode samples (`task_encoder.encode_sample`); the micro-batch is batched here
(`task_encoder.batch`), per lane, from `micro_batch_size` consecutive samples of the lane's stream. An encoder
rank that shares a lane with others (fan-in) takes its part of those samples; one that feeds several lanes merges
their micro-batches with `merge_lane_batches` (schema-aware, see `lanes.py`).

State. `state_dict()` holds, per lane, the energon state of the lane's workers, the samples already pulled from
them but not consumed, the turn, and the skip notes not yet counted: everything needed to continue the exact
stream. The format does not depend on how many lanes a loader serves, so one lane's state restores that lane on
any rank that reads it.

Bad samples. A sample that fails to load or encode is dropped by energon's error handler (a
`SkippedSampleCounter` with a `SkipLedger`) and counted once the consumed samples reach the point where its worker
met it (`skipped_samples`; what each was: `take_skip_records`): the count depends on the stream alone, not on
prefetching, and a restore does not count the re-read drops again. Load errors are held back until the sample leaves
the shuffle buffer (`deferred_errors.py`), so a drop counts where training would have consumed the sample, not
where the buffer read it. energon's own per-sample prints go to the debug log (`energon_prints.py`). A missing or
empty dataset, fewer samples than workers, or a dataset energon gives up on (too many bad samples in a row) is one
`UsageError` line.
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections import deque
from pathlib import Path
from typing import Any

from megatron.energon import TaskEncoder, WorkerConfig, get_savable_loader, get_train_dataset
from megatron.energon.errors import FatalSampleError
from megatron.energon.flavors.webdataset.empty_dataset_error import EmptyDatasetError

from mimo.errors import UsageError

from .deferred_errors import defer_load_errors
from .energon_prints import route_energon_prints
from .lanes import merge_lane_batches
from .skips import SkipLedger, SkippedSampleCounter, SkipRecord

__all__ = ["LaneLoader", "STATE_VERSION"]

STATE_VERSION = 1
_KEPT_RECORDS = 1000  # skip records a loader keeps for the loop to report; older ones are only counted


def _restore_key(sample) -> tuple:
    key = sample.get("__restore_key__") if isinstance(sample, dict) else getattr(sample, "__restore_key__", None)
    if not key or len(key) < 3:
        raise TypeError(f"a sample without energon's restore key ({type(sample).__name__}): the task encoder "
                        f"must keep `__restore_key__` (derive encoded samples from the input sample)")
    return key


def _sample_key(sample) -> str:
    return str(sample.get("__key__") if isinstance(sample, dict) else getattr(sample, "__key__", ""))


class _Stream:
    """One energon loader over consecutive lanes, `per_lane` workers each, its samples queued per worker."""

    def __init__(self, path: str, task_encoder, lanes: range, num_lanes: int, num_workers: int, seed: int,
                 dataset_kwargs: dict):
        k = len(lanes)
        self.path, self.lanes, self.num_workers = path, lanes, num_workers * k
        self.per_lane = max(num_workers, 1)
        self.rank = lanes.start // k
        self.ledger = SkipLedger(self.per_lane * k)
        counter = SkippedSampleCounter(ledger=self.ledger)
        task_encoder = defer_load_errors(task_encoder)  # a copy
        if hasattr(task_encoder, "skip_counter"):  # the task encoder's own drops (e.g. too long) count here too
            task_encoder.skip_counter = counter
        config = WorkerConfig(rank=self.rank, world_size=num_lanes // k, num_workers=self.num_workers,
                              seed_offset=seed, global_error_handler=counter)
        # an evaluation reads another split (split_part) the same way: seeded, repeating, so it never runs dry
        self.what = f"{dataset_kwargs.get('split_part', 'train')} samples".replace("train samples", "training samples")
        try:
            self.dataset = get_train_dataset(path, worker_config=config, batch_size=None, task_encoder=task_encoder,
                                             **dataset_kwargs)
        except EmptyDatasetError as err:
            raise UsageError(f"--data {path}: the dataset has no {self.what} ({err})") from None
        except (FileNotFoundError, ValueError, KeyError) as err:
            raise UsageError(f"--data {path}: not an energon dataset or metadataset ({type(err).__name__}: "
                             f"{err})") from None
        self._check_sizes(path, num_lanes, num_workers)
        self.loader = self.iterator = None
        self.queues = [deque() for _ in range(self.per_lane * k)]  # (index, sample) pulled, not yet consumed
        self.pulled = [-1] * len(self.queues)  # index of the last sample pulled from each worker
        self.restored: list[Any] = [None] * len(self.queues)  # a worker's restored energon state, until it yields
        self.turn = {lane: 0 for lane in lanes}  # the lane's worker whose sample comes next
        self.skipped = {lane: 0 for lane in lanes}
        self.counted: deque[SkipRecord] = deque(maxlen=_KEPT_RECORDS)  # counted, not yet taken by the loop

    def _check_sizes(self, path: str, num_lanes: int, num_workers: int) -> None:
        """energon cannot repeat a worker's empty share of the dataset: it would fail deep in the worker."""
        sizes = [self.dataset.len_worker(w) for w in range(len(self.lanes) * self.per_lane)]
        if 0 not in sizes:
            return
        if num_lanes * self.per_lane == 1:
            raise UsageError(f"--data {path}: the dataset has no {self.what}")
        raise UsageError(f"--data {path}: too few {self.what} for {num_lanes} LLM data-parallel lanes x "
                         f"{self.per_lane} loader workers (some workers get none): lower --num-workers")

    # -- reading ------------------------------------------------------------------------------------------------

    def start(self, lane_states: dict[int, dict] | None) -> None:
        from megatron.energon.savable_loader import SavableDataLoaderState, SavableDatasetCheckpoint

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*pin_memory.*")  # energon pins; on a CPU run it cannot
            self.loader = get_savable_loader(self.dataset)
        if lane_states:
            workers: list[Any] = []
            for lane in self.lanes:
                workers += self._restore_lane(lane, lane_states[lane])
            self.restored = workers
            if self.num_workers == 0:
                states, first = workers[:1], 0
            else:
                states = [w if w is not None else SavableDatasetCheckpoint(state=None, offset=0) for w in workers]
                # one lane: start energon at the lane's turn, so nothing waits in a queue
                first = self.turn[self.lanes.start] if len(self.lanes) == 1 else 0
            if any(s is not None for s in states):
                self.loader.restore_state_rank(SavableDataLoaderState(worker_states=states, next_worker_id=first,
                                                                      micro_batch_size=None))

    def close(self) -> None:
        """Stop the worker processes: closing energon's generator drops torch's iterator, which shuts them down
        (the loader and its generator refer to each other, so dropping them alone waits for the garbage collector)."""
        if self.iterator is not None:
            self.iterator.close()
        self.iterator = self.loader = None

    def _pull(self) -> None:
        if self.iterator is None:  # energon starts its workers here, after any restore
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*pin_memory.*")
                self.iterator = iter(self.loader)
        try:
            sample = next(self.iterator)
        except FatalSampleError as err:
            last = re.search(r"__key__: '([^']+)'", str(err))
            raise UsageError(f"--data {self.path}: energon gave up after too many unreadable samples in a row"
                             f"{f' (the last: {last.group(1)})' if last else ''}; is the dataset corrupt?") from None
        _, global_worker, index = _restore_key(sample)[:3]
        worker = global_worker - self.rank * self.num_workers if self.num_workers else 0
        self.queues[worker].append((index, sample))
        self.pulled[worker] = index
        self.restored[worker] = None  # it has yielded since: energon's own state for it is right again

    def take(self, lane: int) -> tuple[Any, tuple[int, int]]:
        """The lane's next sample, with (global worker id, index in that worker's stream)."""
        offset = (lane - self.lanes.start) * self.per_lane
        worker = offset + self.turn[lane]
        while not self.queues[worker]:
            self._pull()
        index, sample = self.queues[worker].popleft()
        self.turn[lane] = (self.turn[lane] + 1) % self.per_lane
        passed = self.ledger.take(worker, index)
        self.skipped[lane] += len(passed)
        self.counted.extend(passed)
        return sample, (self.lanes.start * self.per_lane + worker, index)

    def loose_skips(self) -> int:
        loose = self.ledger.take_loose()
        self.counted.extend(loose)
        return len(loose)

    # -- state --------------------------------------------------------------------------------------------------

    def _energon_states(self) -> list[Any]:
        """energon's state per worker (None: not started), as of the samples pulled so far."""
        if self.iterator is None:  # nothing pulled since the start or the restore
            return list(self.restored)
        state = self.loader.save_state_rank()
        if state is None:
            return list(self.restored)
        if self.num_workers == 0:
            return list(state.worker_states)
        # energon 7.4.1 reports a restored worker that has not yielded yet at its checkpoint without the samples
        # to skip past it; the state it was restored from is the right one.
        return [r if r is not None else s for r, s in zip(self.restored, state.worker_states)]

    def lane_state(self, lane: int, energon: list[Any]) -> dict:
        workers = range((lane - self.lanes.start) * self.per_lane, (lane - self.lanes.start + 1) * self.per_lane)
        return {
            "energon": pickle.dumps([energon[w] for w in workers] if self.num_workers else energon),
            "turn": self.turn[lane],
            "queued": pickle.dumps([list(self.queues[w]) for w in workers]),
            "pulled": [self.pulled[w] for w in workers],
            "skip_notes": [self.ledger.notes_upto(w, self.pulled[w]) for w in workers],
            "skipped": self.skipped[lane],
        }

    def _restore_lane(self, lane: int, state: dict) -> list[Any]:
        workers = range((lane - self.lanes.start) * self.per_lane, (lane - self.lanes.start + 1) * self.per_lane)
        for w, queued, pulled, notes in zip(workers, pickle.loads(state["queued"]), state["pulled"],
                                            state["skip_notes"]):
            self.queues[w] = deque(queued)
            self.pulled[w] = pulled
            self.ledger.restore(w, notes, pulled)
        self.turn[lane] = state["turn"]
        self.skipped[lane] = state["skipped"]
        return pickle.loads(state["energon"])


class LaneLoader:
    """An iterator of micro-batches for the lanes a rank reads (see the module docstring).

    Args:
        path: an energon dataset directory or a metadataset file.
        task_encoder: an energon task encoder whose `encode_sample` runs in the workers and whose `batch` turns
            a list of encoded samples into the micro-batch dict (e.g. `MultimodalTaskEncoder`).
        micro_batch_size: samples per LLM lane and micro-batch.
        num_lanes: LLM data-parallel lanes.
        lanes: the lanes this rank reads (consecutive).
        lane_part: (part, parts): this rank's share of each micro-batch when `parts` ranks share one lane.
        num_workers: loader worker processes per lane (a rank reading `k` lanes runs `k x num_workers`).
        seed: energon's seed offset: the same seed gives the same streams on every rank.
        start_sample: samples the run consumed before; used only when no state is loaded (the stream is
            then re-read from the start up to there, which gives the same position, only slower).
        shuffle_buffer_size, max_samples_per_sequence, packing_buffer_size, dataset_kwargs: for energon's
            `get_train_dataset`.
    """

    def __init__(self, path: str | Path, task_encoder, *, micro_batch_size: int, num_lanes: int,
                 lanes: range | None = None, lane_part: tuple[int, int] = (0, 1), num_workers: int = 0,
                 seed: int = 0, start_sample: int = 0, shuffle_buffer_size: int | None = 100,
                 max_samples_per_sequence: int | None = 100, packing_buffer_size: int | None = None,
                 **dataset_kwargs):
        path = Path(path)
        if not path.exists():
            raise UsageError(f"--data {path}: no such dataset directory or metadataset file")
        lanes = lanes if lanes is not None else range(num_lanes)
        part, parts = lane_part
        if micro_batch_size % parts or not 0 <= part < parts:
            raise ValueError(f"lane part {part} of {parts} does not split a micro-batch of {micro_batch_size}")
        if num_lanes % len(lanes) or lanes.start % len(lanes):
            raise ValueError(f"lanes {lanes.start}-{lanes.stop - 1} are not one of {num_lanes} lanes' equal blocks")
        if num_workers < 0:
            raise UsageError(f"--num-workers {num_workers} must be 0 or more")
        _check_task_encoder(task_encoder)
        self.task_encoder = task_encoder
        self.micro_batch_size, self.num_lanes, self.lanes = micro_batch_size, num_lanes, lanes
        self.lane_part = lane_part
        self.num_workers, self.start_sample = num_workers, start_sample
        kwargs = dict(shuffle_buffer_size=shuffle_buffer_size, max_samples_per_sequence=max_samples_per_sequence,
                      packing_buffer_size=packing_buffer_size, **dataset_kwargs)
        # With worker processes one loader serves all the lanes; in-process, one loader per lane.
        blocks = [lanes] if num_workers else [range(lane, lane + 1) for lane in lanes]
        self._streams = [_Stream(str(path), task_encoder, block, num_lanes, num_workers, seed, kwargs)
                         for block in blocks]
        self._stream_of = {lane: s for s in self._streams for lane in s.lanes}
        self._state: dict | None = None
        self._started = self._closed = False
        self._loose = 0
        self.micro_batches = 0  # micro-batches yielded per lane, over the whole run
        self.last_rows: list[tuple[int, int, int, str]] = []  # (lane, global worker, index, key) per row

    @classmethod
    def from_context(cls, ctx, task_encoder, **kwargs) -> LaneLoader:
        """The loader for the rank a `DataContext` describes (`ctx.data_path` must be set)."""
        return cls(ctx.data_path, task_encoder, micro_batch_size=ctx.micro_batch_size, num_lanes=ctx.num_lanes,
                   lanes=ctx.lanes, lane_part=ctx.lane_part, num_workers=ctx.num_workers, seed=ctx.seed,
                   start_sample=ctx.start_sample, **kwargs)

    # -- iteration ----------------------------------------------------------------------------------------------

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._closed:
            raise RuntimeError("the lane loader is closed")
        if not self._started:
            self._start()
        part, parts = self.lane_part
        share = self.micro_batch_size // parts
        batches, rows = [], []
        for lane in self.lanes:
            taken = [self._stream_of[lane].take(lane) for _ in range(self.micro_batch_size)]
            mine = taken[part * share:(part + 1) * share]
            batches.append(self._batch([sample for sample, _ in mine]))
            rows += [(lane, worker, index, _sample_key(sample)) for sample, (worker, index) in mine]
        self.micro_batches += 1
        self.last_rows = rows
        return batches[0] if len(batches) == 1 else merge_lane_batches(batches)

    def _batch(self, samples: list) -> Any:
        batch = self.task_encoder.batch(samples)
        if type(self.task_encoder).encode_batch is not TaskEncoder.encode_batch:
            batch = self.task_encoder.encode_batch(batch)
        return batch

    def _start(self) -> None:
        self._started = True
        route_energon_prints()  # before energon forks its workers, which inherit it
        lanes = (self._state or {}).get("lanes")
        for stream in self._streams:
            stream.start({lane: lanes[lane] for lane in stream.lanes} if lanes else None)
        if lanes:
            self.micro_batches = self._state["micro_batches"]
        elif self.start_sample:
            # No saved state (e.g. a rank the checkpoint holds none for): re-read up to the same position.
            per_lane = self.start_sample // self.num_lanes
            for _ in range(per_lane):
                for lane in self.lanes:  # lane by lane in turn: the other lanes' queues stay short
                    self._stream_of[lane].take(lane)
            self.micro_batches = per_lane // self.micro_batch_size
            self.take_skip_records()  # the run before reported those

    def close(self) -> None:
        """Stop the worker processes now rather than when the loader is collected; the loader is done then."""
        self._closed = True
        for stream in self._streams:
            stream.close()

    @property
    def skipped_samples(self) -> int:
        """Samples dropped as unreadable (or not encodable) that this rank's consumed stream has passed."""
        if not self._started and self._state is not None:
            return sum(self._state["lanes"][lane]["skipped"] for lane in self.lanes)
        self._loose += sum(s.loose_skips() for s in self._streams)
        return self._loose + sum(s.skipped[lane] for s in self._streams for lane in s.lanes)

    def take_skip_records(self) -> list[SkipRecord]:
        """What each drop counted since the last call was (dataset, shard, key, error), in the order counted; at
        most the last 1000 per stream between calls."""
        self._loose += sum(s.loose_skips() for s in self._streams)
        records = []
        for stream in self._streams:
            records += stream.counted
            stream.counted.clear()
        return records

    # -- checkpoint state -----------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything needed to continue the exact stream, per lane (plain types and pickled bytes)."""
        if self._closed:
            raise RuntimeError("the lane loader is closed: its state is gone")
        if not self._started and self._state is not None:
            return self._state  # restored, not read since: the same state
        lanes = {}
        for stream in self._streams:
            energon = stream._energon_states()
            lanes.update({lane: stream.lane_state(lane, energon) for lane in stream.lanes})
        return {"version": STATE_VERSION, "num_lanes": self.num_lanes, "num_workers": self.num_workers,
                "micro_batches": self.micro_batches, "lanes": lanes}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (taken by `state_dict` on any rank that read these lanes). Before the first batch."""
        if self._started:
            raise RuntimeError("load_state_dict must come before the first micro-batch")
        if state.get("version") != STATE_VERSION:
            raise UsageError(f"the checkpoint's data-loader state has version {state.get('version')}, this mimo "
                             f"reads version {STATE_VERSION}")
        if state["num_lanes"] != self.num_lanes:
            raise UsageError(f"the checkpoint's data-loader state is for {state['num_lanes']} LLM data-parallel "
                             f"lanes, this run has {self.num_lanes}")
        if state["num_workers"] != self.num_workers:
            raise UsageError(f"the checkpoint's data-loader state was saved with --num-workers "
                             f"{state['num_workers']}, this run uses {self.num_workers}: resume with "
                             f"--num-workers {state['num_workers']} (the workers split the dataset)")
        missing = [lane for lane in self.lanes if lane not in state["lanes"]]
        if missing:
            raise ValueError(f"the data-loader state lacks lanes {missing}")
        self._state = state


def _check_task_encoder(task_encoder) -> None:
    """The lane loader batches in the main process: a task encoder that batches by groups in the workers cannot
    be routed sample by sample."""
    if type(task_encoder).batch_group_criterion is not TaskEncoder.batch_group_criterion:
        raise ValueError(f"{type(task_encoder).__name__} groups samples into batches (batch_group_criterion); "
                         f"the lane loader batches each lane's consecutive samples")
