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
them but not consumed, the turn, and the lane's counts: everything needed to continue the exact stream. The format
does not depend on how many lanes a loader serves, so one lane's state restores that lane on any rank that reads it.

Counts. A sample that cannot be trained on travels the stream as a tombstone (`deferred_errors.py`, `skips.py`);
the loader counts it, by reason, when it consumes it (or the pack that carries it), with the samples trained,
what seq_length cut and the work trained: the samples' tokens (padding left out), images, rows and forward FLOPs
(from each sample's length and images' patches, `sample_flops`) (`data_counts()`; what each skip was:
`take_skip_records`). So the counts depend on the stream alone, not on read-ahead, and a restore neither loses nor
repeats one. energon's own per-sample prints go to the
debug log (`energon_prints.py`).

Errors. A missing or empty dataset, or fewer samples than workers, is one `UsageError` line at start. A data error
while reading (`MAX_SKIPS_IN_A_ROW` skipped samples in a row, a dataset energon gives up on, a shard that cannot
be opened: `damaged_shards.py`) is a `DataError`; with `hold_data_errors` set (the training loop) the loader keeps
it (`data_error`) and hands out empty micro-batches for the rest of the iteration, so every rank finishes the
iteration and the loop stops at its boundary, saving the state `mark_boundary()` kept.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import torch
from megatron.energon import TaskEncoder

from mimo.errors import UsageError
from mimo.wording import counted

from .counts import DataCounts
from .energon_prints import route_energon_prints
from .lane_stream import MAX_SKIPS_IN_A_ROW, DataError, LaneStream
from .lanes import merge_lane_batches
from .read_ahead import Made, MadeAhead
from .skips import SkipRecord
from .task_encoder import EncodedSample

__all__ = ["DataError", "LaneLoader", "MAX_SKIPS_IN_A_ROW", "STATE_VERSION"]

STATE_VERSION = 2


def _sample_key(sample) -> str:
    return str(sample.get("__key__") if isinstance(sample, dict) else getattr(sample, "__key__", ""))


class LaneLoader:
    """An iterator of micro-batches for the lanes a rank reads (see the module docstring). It defines every member
    of `mimo.plugins.DataSource`, so it is one without importing it (mimo.data may not import mimo.plugins).

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
        sample_flops: `(tokens, image_patches) -> forward FLOPs` of one sample (`DataContext.sample_flops`), or
            None: the counts hold no FLOPs.
    """

    # DataSource's members kept as plain attributes (the class must define them to count as one)
    resumable = True  # state_dict continues the exact stream
    hold_data_errors = False  # the training loop's: keep a DataError, hand out empty micro-batches

    def __init__(self, path: str | Path, task_encoder, *, micro_batch_size: int, num_lanes: int,
                 lanes: range | None = None, lane_part: tuple[int, int] = (0, 1), num_workers: int = 0,
                 seed: int = 0, start_sample: int = 0, shuffle_buffer_size: int | None = 100,
                 max_samples_per_sequence: int | None = 100, packing_buffer_size: int | None = None,
                 read_ahead: int = 0, pin_memory: bool = False, sample_flops=None, **dataset_kwargs):
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
        self._streams = [LaneStream(str(path), task_encoder, block, num_lanes, num_workers, seed, kwargs,
                                    sample_flops) for block in blocks]
        self._stream_of = {lane: s for s in self._streams for lane in s.lanes}
        self._state: dict | None = None
        self._started = self._closed = False
        self._loose = 0
        self.hold_data_errors = False
        self._error: str | None = None  # a DataError met while making micro-batches (read ahead or not)
        self._made = 0  # micro-batches made per lane, over the whole run
        # read_ahead.py: micro-batches made in a thread, pinned; what the loop reads is as of the one it consumed
        # Not without worker processes: energon then iterates in this process, one dataset at a time (its active
        # worker config is global), and an evaluation's loader would meet the thread's.
        self.read_ahead, self.pin_memory = (read_ahead if num_workers else 0), pin_memory
        self._lock = threading.Lock()  # held while a micro-batch is made: energon's state is read between two
        self._ahead: MadeAhead | None = None
        self._consumed: Made | None = None  # the last micro-batch handed out, with the view after it
        self._boundary: Made | None = None  # mark_boundary's: what a save after a data error writes
        self._records: list[SkipRecord] = []  # skips of the micro-batches handed out, not yet taken

    @classmethod
    def from_context(cls, ctx, task_encoder, **kwargs) -> LaneLoader:
        """The loader for the rank a `DataContext` describes (`ctx.data_path` must be set)."""
        return cls(ctx.data_path, task_encoder, micro_batch_size=ctx.micro_batch_size, num_lanes=ctx.num_lanes,
                   lanes=ctx.lanes, lane_part=ctx.lane_part, num_workers=ctx.num_workers, seed=ctx.seed,
                   start_sample=ctx.start_sample, read_ahead=getattr(ctx, "read_ahead", 0),
                   pin_memory=getattr(ctx, "pin_memory", False), sample_flops=getattr(ctx, "sample_flops", None),
                   **kwargs)

    # -- iteration ----------------------------------------------------------------------------------------------

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._closed:
            raise RuntimeError("the lane loader is closed")
        if not self._started:
            self._start()
        if self.read_ahead > 0:
            if self._ahead is None:
                self._ahead = MadeAhead(self._make, self.read_ahead, self._lock, self.pin_memory)
            made = self._ahead.next()
        else:
            made = self._make()
        self._consumed = made
        self._records += made.records  # named when consumed, not when made ahead
        for stream, view in zip(self._streams, (self._boundary or made).views):
            stream.trim(view)  # what a state may still need: from the boundary kept, else from this one
        return made.batch

    def _make(self) -> Made:
        """The next micro-batch of this rank's lanes, with the loader's view right after it."""
        part, parts = self.lane_part
        share = self.micro_batch_size // parts
        batches, rows = [], []
        try:
            if self._error is not None:
                raise DataError(self._error)
            for lane in self.lanes:
                taken = [self._stream_of[lane].take(lane) for _ in range(self.micro_batch_size)]
                mine = taken[part * share:(part + 1) * share]
                batches.append(self._batch([sample for sample, _ in mine]))
                rows += [(lane, worker, index, _sample_key(sample)) for sample, (worker, index) in mine]
        except DataError as err:
            if not self.hold_data_errors:
                raise
            # every rank of the lane meets it at the same micro-batch (they read the same stream): an empty
            # micro-batch (padding, no loss, no images) lets all finish the iteration together
            self._error = str(err)
            empty = EncodedSample(__key__="", __restore_key__=(), tokens=torch.zeros(0, dtype=torch.long),
                                  labels=torch.zeros(0, dtype=torch.long), loss_mask=torch.zeros(0),
                                  position_ids=torch.zeros(0, dtype=torch.long), images=[], seqlens=[])
            batches, rows = [self._batch([empty] * share) for _ in self.lanes], []
        self._made += 1
        batch = batches[0] if len(batches) == 1 else merge_lane_batches(batches)
        return Made(batch, [s.view() for s in self._streams], self._made, self._error, rows, self._counted())

    def _counted(self) -> list[SkipRecord]:
        """The skip records the streams counted since the last call (popleft: the other thread may append)."""
        records = []
        for stream in self._streams:
            while stream.counted:
                records.append(stream.counted.popleft())
        return records

    @property
    def data_error(self) -> str | None:
        """The data error held, as of the micro-batches handed out (one read ahead is not the loop's yet)."""
        return self._consumed.data_error if self._consumed is not None else None

    @property
    def micro_batches(self) -> int:
        """Micro-batches handed out per lane, over the whole run."""
        if self._consumed is not None:
            return self._consumed.micro_batches
        return self._state["micro_batches"] if self._state is not None else 0

    @property
    def last_rows(self) -> list[tuple[int, int, int, str]]:
        """(lane, global worker, index, key) of each row of the last micro-batch handed out."""
        return self._consumed.rows if self._consumed is not None else []

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
            self._made = self._state["micro_batches"]
        elif self.start_sample:
            # No saved state (e.g. a rank the checkpoint holds none for): re-read up to the same position.
            per_lane = self.start_sample // self.num_lanes
            for _ in range(per_lane):
                for lane in self.lanes:  # lane by lane in turn: the other lanes' queues stay short
                    self._stream_of[lane].take(lane)
            self._made = per_lane // self.micro_batch_size
            self.take_skip_records()  # the run before reported those

    def close(self) -> None:
        """Stop the worker processes now rather than when the loader is collected; the loader is done then."""
        self._closed = True
        if self._ahead is not None:
            self._ahead.close()  # first: its thread reads the streams
        for stream in self._streams:
            stream.close()

    def data_counts(self) -> DataCounts:
        """What this rank's lanes consumed so far, over the whole run: samples trained, skipped by reason, cut by
        seq_length, the trained samples' tokens, images, rows and FLOPs; `data_error` 1 once a data error stopped
        the reading."""
        if not self._started and self._state is not None:
            total = sum((DataCounts(**self._state["lanes"][lane]["counts"]) for lane in self.lanes), DataCounts())
        else:
            self._loose += sum(s.loose_skips() for s in self._streams)
            views = self._consumed.views if self._consumed is not None else [s.view() for s in self._streams]
            total = sum((count for view in views for count in view.counts.values()), DataCounts())
        total.unreadable += self._loose
        total.data_error = int(self.data_error is not None)
        return total

    @property
    def skipped_samples(self) -> int:
        """Samples skipped (every reason) that this rank's consumed stream has passed."""
        return self.data_counts().skipped

    @property
    def longest_needed(self) -> int:
        """The longest whole sample (tokens) read so far: what seq_length would have to be to cut none."""
        return max((s.needed for s in self._streams), default=0)

    def size_note(self) -> str | None:
        """A note when a lane's training data is smaller than a micro-batch: every micro-batch repeats samples."""
        sizes = [size for s in self._streams for size in getattr(s, "lane_sizes", ())]
        if not sizes or min(sizes) >= self.micro_batch_size:
            return None
        smallest = min(sizes)
        return (f"note: --data {self._streams[0].path} has {counted(smallest, self._streams[0].what)} per data lane, "
                f"fewer than a micro-batch of {self.micro_batch_size}: every micro-batch repeats samples (each about "
                f"{counted(-(-self.micro_batch_size // max(smallest, 1)), 'time')})")

    def mark_boundary(self) -> None:
        """Keep the state as of now (an iteration boundary): what a save after a data error writes."""
        if self.data_error is None and self._consumed is not None:
            self._boundary = self._consumed

    def take_skip_records(self) -> list[SkipRecord]:
        """What each drop counted since the last call was (dataset, shard, key, error), in the order counted; at
        most the last 1000 per stream between calls."""
        self._loose += sum(s.loose_skips() for s in self._streams)
        records, self._records = self._records, []
        if self._ahead is None:  # else the thread takes the rest with the micro-batches it makes
            records += self._counted()
        return records

    # -- checkpoint state -----------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything needed to continue the exact stream, per lane (plain types and pickled bytes)."""
        if self._closed:
            raise RuntimeError("the lane loader is closed: its state is gone")
        if not self._started and self._state is not None:
            return self._state  # restored, not read since: the same state
        # as of the micro-batch consumed last, or after a data error the last complete iteration's
        made = self._boundary if self.data_error is not None and self._boundary is not None else self._consumed
        lanes = {}
        with self._lock:  # between two micro-batches made ahead: energon's state is that of what was pulled
            for i, stream in enumerate(self._streams):
                energon = stream._energon_states()
                view = made.views[i] if made is not None else None
                lanes.update({lane: stream.lane_state(lane, energon, view) for lane in stream.lanes})
        return {"version": STATE_VERSION, "num_lanes": self.num_lanes, "num_workers": self.num_workers,
                "micro_batches": made.micro_batches if made is not None else self._made, "lanes": lanes}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (taken by `state_dict` on any rank that read these lanes). Before the first batch."""
        if self._started:
            raise RuntimeError("load_state_dict must come before the first micro-batch")
        if state.get("version") == 1:
            state = _from_version_1(state, self.start_sample // max(self.num_lanes, 1))
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
            # e.g. saved where each rank read its lane, resumed where colocated encoders at a larger TP than the
            # LLM's read every lane their replica feeds
            raise UsageError(f"the checkpoint's data-loader state holds lanes {sorted(state['lanes'])}, this rank "
                             f"reads lanes {list(self.lanes)}: resume on the layout it was saved on (the same "
                             f"--encoder-tp), or pass --finetune")
        self._state = state


def _check_task_encoder(task_encoder) -> None:
    """The lane loader batches in the main process: a task encoder that batches by groups in the workers cannot
    be routed sample by sample."""
    if type(task_encoder).batch_group_criterion is not TaskEncoder.batch_group_criterion:
        raise ValueError(f"{type(task_encoder).__name__} groups samples into batches (batch_group_criterion); "
                         f"the lane loader batches each lane's consecutive samples")


def _from_version_1(state: dict, samples_per_lane: int) -> dict:
    """A state saved by a mimo that counted skips by stream position: its skips (and its notes not yet counted)
    count as unreadable, its trained samples are the lane's share of those consumed."""
    lanes = {}
    for lane, old in state["lanes"].items():
        new = {k: v for k, v in old.items() if k not in ("skip_notes", "skipped")}
        noted = sum(len(notes) for notes in old.get("skip_notes", []))
        new["counts"] = dataclasses.asdict(DataCounts(samples=samples_per_lane,
                                                      unreadable=old.get("skipped", 0) + noted))
        lanes[lane] = new
    return {**state, "version": STATE_VERSION, "lanes": lanes}
