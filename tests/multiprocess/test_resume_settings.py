"""Resuming (`mimo run --load`) takes the provider and settings saved in the checkpoint, as `mimo eval` and
`mimo generate` do: a run trained with --set needs no repeat of it, and a --set that changes a saved setting is
one line naming both values and the checkpoint's run.yaml."""

from __future__ import annotations

from helpers import run_mimo

ENV = {"TORCH_COMPILE_DISABLE": "1"}


def test_resume_takes_the_saved_provider_and_settings(tmp_path):
    save = str(tmp_path / "ckpt")
    trained = run_mimo("run", "--provider", "mock-vlm", "--set", "projection=affine", "--train-iters", "2",
                       "--save", save, "--save-interval", "2", env=ENV)
    assert trained.returncode == 0, trained.stderr
    resumed = run_mimo("run", "--provider", "mock-vlm", "--load", save, "--save", save, "--train-iters", "3",
                       env=ENV)  # without the --set it was trained with
    assert resumed.returncode == 0, resumed.stderr
    assert "projection: affine" in (tmp_path / "ckpt" / "iter_0000003" / "run.yaml").read_text()

    # without --provider: the provider, too, comes from the checkpoint
    changed = run_mimo("run", "--load", save, "--save", save, "--train-iters", "4", "--set", "projection=mlp", env=ENV)
    assert changed.returncode == 2 and "Traceback" not in changed.stderr
    line = changed.stderr.strip()
    assert line.startswith(f"error: --set projection=mlp, but {save}/iter_0000003 was saved with projection=affine")
    assert f"{save}/iter_0000003/run.yaml" in line and "\n" not in line
    other = run_mimo("run", "--provider", "nemotron-moe-vlm-tiny", "--load", save, "--save", save, env=ENV)
    assert other.returncode == 2 and "was saved by provider 'mock-vlm'" in other.stderr
