"""A checkpoint against the run, before any tensor is read: which tensor and which settings differ, and which loop
options a resume may change."""

from pathlib import Path

import pytest

from mimo.core.checkpoint.match import check_kept_options, first_difference, mismatch_line
from mimo.errors import UsageError

CKPT = Path("runs/a/iter_0000002")
MODEL = {"embedding.weight": (260, 64), "layers.fc1.weight": (2, 256, 64), "final_norm.weight": (64,)}


def saved(shapes: dict) -> dict:
    return {k: (v, "torch.float32") for k, v in shapes.items()}


def test_the_first_differing_tensor_in_key_order():
    assert first_difference(MODEL, saved(MODEL)) is None
    assert first_difference(MODEL, saved({**MODEL, "extra.weight": (3,)})) is None  # left out by the load
    wider = {**MODEL, "final_norm.weight": (32,), "layers.fc1.weight": (2, 256, 32)}
    assert first_difference(MODEL, saved(wider)) == ("final_norm.weight", (32,), (64,))
    missing = {k: v for k, v in MODEL.items() if k != "embedding.weight"}
    assert first_difference(MODEL, saved(missing)) == ("embedding.weight", None, (260, 64))


def test_settings_that_differ_are_named_first_those_that_are_the_tensors_sizes():
    line = mismatch_line(("final_norm.weight", (32,), (64,)), {"stage": "a", "hidden_size": 32, "dropout": 0.0},
                         {"stage": "b", "hidden_size": 64, "dropout": 0.0}, CKPT, "--load")
    assert line == (f"--load {CKPT} was saved with other settings: hidden_size 32 there, 64 here; stage 'a' there, "
                    f"'b' here; its model does not fit this run's (tensor final_norm.weight has shape [32] there, [64] "
                    f"here)")


def test_matching_settings_name_the_tensor():
    same = {"hidden_size": 64, "mean": (0.5, 0.5)}
    assert mismatch_line(("layers.fc1.weight", (3, 256, 64), (2, 256, 64)), same, {**same, "mean": [0.5, 0.5]},
                         CKPT, "--pretrained") == (
        f"--pretrained {CKPT} does not fit this run's model: tensor layers.fc1.weight has shape [3, 256, 64] there, "
        f"[2, 256, 64] here")
    assert mismatch_line(("embedding.weight", None, (260, 64)), same, same, CKPT, "--load").endswith(
        "tensor embedding.weight is not in the checkpoint (shape [260, 64] here)")


def options(precision="fp32", lr=0.001, llm_tp=1, seed=1234, train_iters=4):
    return {"training": {"precision": precision, "seed": seed, "train_iters": train_iters},
            "optimizer": {"lr": lr, "min_lr": 0.0}, "layout": {"llm_tp": llm_tp}}


def test_options_a_resume_may_change_and_those_it_keeps():
    check_kept_options(options(), options(llm_tp=2, seed=7, train_iters=8), CKPT)  # layout, seed, length: free
    check_kept_options({}, options(), CKPT)  # a checkpoint that recorded no options
    with pytest.raises(UsageError) as err:
        check_kept_options(options(), options(precision="bf16"), CKPT)
    assert str(err.value) == (f"--precision bf16 differs from the checkpoint's fp32 ({CKPT}), whose optimizer state "
                              f"belongs to --precision fp32: resume with --precision fp32, or pass --no-load-optim "
                              f"(a fresh optimizer)")
    with pytest.raises(UsageError, match=r"^--lr 0.002 differs from the checkpoint's 0.001 .*--no-load-optim "
                                         r"--no-load-scheduler"):
        check_kept_options(options(), options(lr=0.002), CKPT)
    saved, bf16 = options(precision="bf16"), options(precision="bf16")
    saved["optimizer"]["optimizer_precision"], bf16["optimizer"]["optimizer_precision"] = "fp32", "bf16"
    with pytest.raises(UsageError) as err:
        check_kept_options(saved, bf16, CKPT)
    assert str(err.value).startswith("--optimizer-precision bf16 differs from the checkpoint's fp32") and str(
        err.value).endswith("resume with --optimizer-precision fp32, or pass --no-load-optim (a fresh optimizer)")
    check_kept_options(options(precision="bf16"), bf16, CKPT)  # saved before the option existed: nothing to compare
