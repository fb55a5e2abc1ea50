"""The built-in providers train through `mimo run` on CPU on the synthetic workloads where the encoder carries its
share (issue 48): several images per sample (nemotron-moe-vlm-tiny, mock-vlm), and a video clip whose frames RADIO
groups in tubelets through its video embedder (which then trains), with the encoders once per step (the clips'
frame counts concatenated)."""

from __future__ import annotations

import math

from helpers import read_metrics, run_mimo

COMMON = ("run", "--device", "cpu", "--log-interval", "1", "--seed", "3", "--train-iters", "3", "--micro-batch-size",
          "2", "--num-microbatches", "2")
ENV = {"OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1"}


def train(tmp_path, name, *settings: str, args=(), provider="nemotron-moe-vlm-tiny"):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_mimo(*COMMON, "--provider", provider, "--metrics-file", str(metrics), *args,
                      *[x for s in settings for x in ("--set", s)], env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(metrics)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["lm_loss"]) and r["lm_loss"] > 0 for r in records), records
    assert all(r["grad_norm_images"] > 0 for r in records), records  # the encoder got its gradients
    return records


def test_several_images_per_sample_train(tmp_path):
    train(tmp_path, "documents", "images_per_sample=3")


def test_video_clips_train_in_tubelets_with_the_encoders_once_per_step(tmp_path):
    train(tmp_path, "video", "images_per_sample=1", "video_frames=5", "video_temporal_patch_size=2",
          "patches_per_image=36", args=("--encoder-pass", "step"))


def test_mock_vlm_trains_with_several_images_per_sample(tmp_path):
    train(tmp_path, "mock", "images_per_sample=3", "seq_length=64", provider="mock-vlm")
