"""One energon loader over consecutive lanes of the lane loader (`lane_loader.py`): its samples queued per worker,
taken lane by lane in turn, and counted as they are consumed (samples trained, skipped by reason, cut by
seq_length, see `skips.py`; and the work they are: tokens, images, rows and forward FLOPs)."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
import re
import warnings
from collections import deque
from typing import Any

from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
from megatron.energon.errors import FatalSampleError
from megatron.energon.flavors.webdataset.empty_dataset_error import EmptyDatasetError

from mimo.errors import UsageError
from mimo.wording import counted, plural

from .check import unreadable_dataset
from .counts import DataCounts
from .damaged_shards import shard_stop_line
from .deferred_errors import defer_load_errors
from .skips import REASONS, SkippedSampleCounter, SkipRecord
from .splits import hold_out_hint

__all__ = ["DataError", "LaneStream", "MAX_SKIPS_IN_A_ROW", "StreamView", "count_work"]

_KEPT_RECORDS = 1000  # skip records a loader keeps for the loop to report; older ones are only counted
MAX_SKIPS_IN_A_ROW = 100  # skipped samples in a row before the data is given up on (it would read forever)


@dataclass
class StreamView:
    """A stream's counters as of one micro-batch: the last index taken from each worker, the lanes' turns, counts
    and skips in a row (small copies; the samples not consumed stay in the stream's history)."""

    taken: list[int]
    turn: dict[int, int]
    counts: dict[int, DataCounts]
    in_a_row: dict[int, int]


class DataError(UsageError):
    """The data cannot go on (e.g. nothing but skipped samples): one line, the run stops at the boundary."""


def _restore_key(sample) -> tuple:
    key = sample.get("__restore_key__") if isinstance(sample, dict) else getattr(sample, "__restore_key__", None)
    if not key or len(key) < 3:
        raise TypeError(f"a sample without energon's restore key ({type(sample).__name__}): the task encoder "
                        f"must keep `__restore_key__` (derive encoded samples from the input sample)")
    return key


class LaneStream:
    """One energon loader over consecutive lanes, `per_lane` workers each, its samples queued per worker."""

    def __init__(self, path: str, task_encoder, lanes: range, num_lanes: int, num_workers: int, seed: int,
                 dataset_kwargs: dict, sample_flops=None):
        """`sample_flops(tokens, image_patches)`: one sample's forward FLOPs (or None: not counted)."""
        k = len(lanes)
        self.sample_flops = sample_flops
        self.path, self.lanes, self.num_workers = path, lanes, num_workers * k
        self.per_lane = max(num_workers, 1)
        self.rank = lanes.start // k
        # what still fails inside energon (not a tombstone) counts at once, as unreadable
        self.loose = SkippedSampleCounter()
        self.loose_counted = 0
        task_encoder = defer_load_errors(task_encoder)  # a copy
        config = WorkerConfig(rank=self.rank, world_size=num_lanes // k, num_workers=self.num_workers,
                              seed_offset=seed, global_error_handler=self.loose)
        # an evaluation reads another split (split_part) the same way: seeded, repeating, so it never runs dry
        split = dataset_kwargs.get("split_part", "train")
        self.what = "training sample" if split == "train" else f"{split} sample"
        # the eval split may be --eval-data's: named by its path; how a dataset made for training alone gets one
        self.who = f"--data {path}" if split == "train" else f"the eval data {path}"
        self.how = "" if split == "train" else f": {hold_out_hint(split)}"
        try:
            self.dataset = get_train_dataset(path, worker_config=config, batch_size=None, task_encoder=task_encoder,
                                             **dataset_kwargs)
        except EmptyDatasetError as err:
            raise UsageError(f"{self.who}: the dataset has no {plural(self.what)} ({err}){self.how}") from None
        except (FileNotFoundError, ValueError, KeyError, ImportError, AttributeError, TypeError) as err:
            # a sample class that cannot be imported (preflight names it first: data/check.py)
            raise UsageError(unreadable_dataset(path) or f"--data {path}: not an energon dataset or metadataset "
                             f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
        self._check_sizes(path, num_lanes, num_workers)
        self.loader = self.iterator = None
        self.queues = [deque() for _ in range(self.per_lane * k)]  # (index, sample) pulled, not yet taken
        # (index, sample) pulled and not yet consumed by the loop: the queues and what was taken ahead of it
        # (read_ahead.py); a saved state's queues are these, past the consumed view's `taken`
        self.history = [deque() for _ in self.queues]
        self.pulled = [-1] * len(self.queues)  # index of the last sample pulled from each worker
        self.taken = [-1] * len(self.queues)  # index of the last sample taken from each worker
        self.restored: list[Any] = [None] * len(self.queues)  # a worker's restored energon state, until it yields
        self.turn = {lane: 0 for lane in lanes}  # the lane's worker whose sample comes next
        self.counts = {lane: DataCounts() for lane in lanes}
        self.in_a_row = {lane: 0 for lane in lanes}  # skipped samples consumed since the last trained one
        self.needed = 0  # the longest sample's whole length seen (for the truncation warning's suggestion)
        self.counted: deque[SkipRecord] = deque(maxlen=_KEPT_RECORDS)  # counted, not yet taken by the loop

    def _check_sizes(self, path: str, num_lanes: int, num_workers: int) -> None:
        """energon cannot repeat a worker's empty share of the dataset: it would fail deep in the worker."""
        sizes = [self.dataset.len_worker(w) for w in range(len(self.lanes) * self.per_lane)]
        self.lane_sizes = [sum(sizes[i:i + self.per_lane]) for i in range(0, len(sizes), self.per_lane)]
        if 0 not in sizes:
            return
        if num_lanes * self.per_lane == 1:
            raise UsageError(f"{self.who}: the dataset has no {plural(self.what)}{self.how}")
        raise UsageError(f"{self.who}: too few {plural(self.what)} for {counted(num_lanes, 'LLM data-parallel lane')} "
                         f"x {counted(self.per_lane, 'loader worker')} (some workers get none): lower --num-workers")

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
            raise DataError(f"--data {self.path}: energon gave up after too many unreadable samples in a row"
                            f"{f' (the last: {last.group(1)})' if last else ''}; is the dataset corrupt?") from None
        _, global_worker, index = _restore_key(sample)[:3]
        worker = global_worker - self.rank * self.num_workers if self.num_workers else 0
        self.queues[worker].append((index, sample))
        self.history[worker].append((index, sample))
        self.pulled[worker] = index
        self.restored[worker] = None  # it has yielded since: energon's own state for it is right again

    def take(self, lane: int) -> tuple[Any, tuple[int, int]]:
        """The lane's next sample (or pack) with tokens, with (global worker id, index in that worker's stream);
        the skipped samples consumed on the way, and those it carries, are counted."""
        while True:
            offset = (lane - self.lanes.start) * self.per_lane
            worker = offset + self.turn[lane]
            while not self.queues[worker]:
                self._pull()
            index, sample = self.queues[worker].popleft()
            self.taken[worker] = index
            self.turn[lane] = (self.turn[lane] + 1) % self.per_lane
            if self._count(lane, sample):
                return sample, (self.lanes.start * self.per_lane + worker, index)

    def _count(self, lane: int, sample) -> bool:
        """Count what `sample` holds; whether it has tokens to train on."""
        counts, dropped = self.counts[lane], getattr(sample, "dropped", None) or []
        for record in dropped:
            setattr(counts, record.reason, getattr(counts, record.reason) + 1)
            self.counted.append(record)
        counts.samples += len(getattr(sample, "seqlens", ()) or ())
        counts.cut_tokens += getattr(sample, "cut_tokens", 0)
        counts.cut_answer_tokens += getattr(sample, "cut_answer_tokens", 0)
        counts.answer_tokens += getattr(sample, "answer_tokens", 0)
        self.needed = max(self.needed, getattr(sample, "needed_tokens", 0),
                          *(r.needed_tokens or 0 for r in dropped))
        whole = next((r for r in dropped if r.whole_shard), None)
        if whole is not None:  # every sample of that shard would be skipped: the user must mend or drop it
            raise DataError(shard_stop_line(self.path, whole))
        if len(sample.tokens if hasattr(sample, "tokens") else sample["tokens"]):
            self.in_a_row[lane] = 0
            if not count_work(counts, sample, self.sample_flops):
                self.sample_flops = None  # the run counts no FLOPs per sample
            return True
        self.in_a_row[lane] += len(dropped)
        if self.in_a_row[lane] > MAX_SKIPS_IN_A_ROW:
            raise DataError(self._given_up(lane))
        return False

    def _given_up(self, lane: int) -> str:
        last = list(self.counted)[-MAX_SKIPS_IN_A_ROW:]
        reasons = {r: sum(x.reason == r for x in last) for r in REASONS}
        why = ", ".join(f"{n} {REASONS[r]}" for r, n in reasons.items() if n)
        most = max(reasons.values())
        hint = ("raise seq_length (--set seq_length=N)" if reasons["too_long"] == most else
                "make the images smaller or raise --pack-image-tokens where `mimo plan` says it fits"
                if reasons["over_image_budget"] == most else "repair the dataset (the lines above name the samples)")
        return (f"--data {self.path}: the last {MAX_SKIPS_IN_A_ROW} samples read were all skipped ({why}): "
                f"{hint}")

    def loose_skips(self) -> int:
        """Samples dropped inside energon since the last call (counted at once, as unreadable)."""
        total = self.loose.count
        new, self.loose_counted = total - self.loose_counted, total
        self.counted.extend(self.loose.take_records())
        return new

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

    def view(self) -> StreamView:
        """What the loop's state is made of as of now, without the samples (those stay in `history`)."""
        return StreamView(list(self.taken), dict(self.turn),
                          {lane: dataclasses.replace(c) for lane, c in self.counts.items()}, dict(self.in_a_row))

    def trim(self, view: StreamView) -> None:
        """Forget the samples consumed as of `view` (popleft alone: safe beside the thread that appends)."""
        for history, taken in zip(self.history, view.taken):
            while history and history[0][0] <= taken:
                history.popleft()

    def lane_state(self, lane: int, energon: list[Any], view: StreamView | None = None) -> dict:
        """The lane's state as of `view` (default: now): energon's state of what was pulled, and the samples
        pulled but not consumed as of `view`, which a restore queues first. Not while samples are being pulled."""
        view = view or self.view()
        workers = range((lane - self.lanes.start) * self.per_lane, (lane - self.lanes.start + 1) * self.per_lane)
        return {
            "energon": pickle.dumps([energon[w] for w in workers] if self.num_workers else energon),
            "turn": view.turn[lane],
            "queued": pickle.dumps([[item for item in self.history[w] if item[0] > view.taken[w]] for w in workers]),
            "pulled": [self.pulled[w] for w in workers],
            "counts": dataclasses.asdict(view.counts[lane]),
            "in_a_row": view.in_a_row[lane],
        }

    def _restore_lane(self, lane: int, state: dict) -> list[Any]:
        workers = range((lane - self.lanes.start) * self.per_lane, (lane - self.lanes.start + 1) * self.per_lane)
        for w, queued, pulled in zip(workers, pickle.loads(state["queued"]), state["pulled"]):
            self.queues[w], self.history[w] = deque(queued), deque(queued)
            self.pulled[w] = pulled
            self.taken[w] = queued[0][0] - 1 if queued else pulled
        self.turn[lane] = state["turn"]
        self.counts[lane] = DataCounts(**state["counts"])
        self.in_a_row[lane] = state.get("in_a_row", 0)
        return pickle.loads(state["energon"])


def count_work(counts: DataCounts, sample, sample_flops) -> bool:
    """Add a trained row's work to `counts`: its samples' tokens (not the row's padding), images, and forward FLOPs
    by `sample_flops(tokens, image_patches)` per sample, each with its own images. False when `sample_flops`
    counts none (it returned None): the row's FLOPs are then left out."""
    seqlens = list(getattr(sample, "seqlens", ()) or ())
    images = list(getattr(sample, "images", ()) or ())
    counts.rows += 1
    counts.tokens += sum(seqlens)
    counts.images += len(images)
    if sample_flops is None:
        return False
    per_sample = list(getattr(sample, "image_counts", ()) or ())
    if len(per_sample) != len(seqlens) or sum(per_sample) != len(images):
        per_sample = [len(images)] + [0] * (len(seqlens) - 1)  # not said: the first sample's
    flops, first = 0.0, 0
    for length, count in zip(seqlens, per_sample):
        patches = [n for image in images[first:first + count] for n in getattr(image, "encoder_patches", ())]
        first += count
        one = sample_flops(length, patches)
        if one is None:
            return False
        flops += one
    counts.flops += int(round(flops))
    return True
