"""Video clips in the packed image buffer: a clip is a list of frames of one size, an image a clip of one frame.

megatron-core's RADIO (dynamic resolution, `temporal_patch_dim` T > 1) takes every frame as its own entry of the
packed buffer and `imgs_sizes`, plus `num_frames` per clip; it groups each clip's consecutive frames into tubelets
of T (the last one padded with copies of the clip's final frame), embeds a tubelet with its video patch embedder and
encodes it as one sequence of one frame's patches. A clip of one frame stays an image. With T = 1 there is no
grouping: every frame is an image of its own, and the encoder input carries no `num_frames`.

So a clip of `f` frames gives `clip_tubelets(f, T)` sequences of one frame's grid, and takes that many times one
frame's tokens among the placeholders.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["NUM_FRAMES", "clip_tokens", "clip_tubelets", "collate_clips", "concat_clips", "frames_per_clip",
           "sequence_grids"]

NUM_FRAMES = "num_frames"  # the encoder argument: frames per clip, a list of ints (it stays on the host)


def clip_tubelets(frames: int, temporal_patch_size: int) -> int:
    """Sequences the encoder makes of a clip of `frames` frames (megatron-core's grouping)."""
    if frames < 1 or temporal_patch_size < 1:
        raise ValueError(f"a clip needs at least one frame and a temporal patch of at least one, got {frames}, "
                         f"{temporal_patch_size}")
    return 1 if frames == 1 else math.ceil(frames / temporal_patch_size)


def clip_tokens(clip: Sequence, temporal_patch_size: int) -> int:
    """Placeholders a clip of processed frames (`ProcessedImage`, one size) takes: one frame's per tubelet."""
    return clip_tubelets(len(clip), temporal_patch_size) * clip[0].num_tokens


def collate_clips(mode, clips: Sequence[Sequence], temporal_patch_size: int) -> dict:
    """Clips of processed frames as one encoder input: the image mode's input for every frame in order, and, where
    the encoder groups frames (T > 1) and a clip has several, `num_frames` per clip."""
    inputs = mode.collate([frame for clip in clips for frame in clip])
    if temporal_patch_size > 1 and any(len(clip) > 1 for clip in clips):
        inputs[NUM_FRAMES] = [len(clip) for clip in clips]
    return inputs


def frames_per_clip(inputs: dict) -> list[int]:
    """Frames per clip of a dynamic-resolution encoder input: its `num_frames`, else one per image."""
    frames = inputs.get(NUM_FRAMES)
    return list(frames) if frames is not None else [1] * len(inputs["imgs_sizes"])


def concat_clips(mode, inputs: list[dict]) -> dict:
    """Several collated inputs as one (the image mode's concat), their clips' frame counts one after another."""
    merged = mode.concat(inputs)
    if any(NUM_FRAMES in i for i in inputs):
        merged[NUM_FRAMES] = [n for i in inputs for n in frames_per_clip(i)]
    return merged


def sequence_grids(frame_grids: Sequence[tuple[int, int]], num_frames: Sequence[int] | None,
                   temporal_patch_size: int) -> list[tuple[int, int]]:
    """The patch grid of each sequence the encoder outputs, in order, from every frame's grid: a clip's first
    frame's grid once per tubelet (no `num_frames`, or T = 1: one sequence per frame)."""
    if num_frames is None or temporal_patch_size == 1:
        return list(frame_grids)
    if sum(num_frames) != len(frame_grids):
        raise ValueError(f"num_frames {list(num_frames)} add up to {sum(num_frames)} frames, the input has "
                         f"{len(frame_grids)}")
    grids, start = [], 0
    for frames in num_frames:
        grids += [frame_grids[start]] * clip_tubelets(frames, temporal_patch_size)
        start += frames
    return grids
