"""The built-in Nemotron variants default to the released omni model's projector (mlp with its input RMSNorm), the
form `mimo ckpt export-hf` writes; Megatron-LM's affine projection is one setting away; a checkpoint saved when
affine was the default records it, resumes from its run file, and is refused in one line naming the setting when
the run asks for the new default."""

from __future__ import annotations

from helpers import run_mimo

from mimo.plugins import Registry
from mimo.providers.nemotron import VARIANTS, NemotronVLMSettings

ENV = {"TORCH_COMPILE_DISABLE": "1"}
RUN = ("run", "--provider", "nemotron-moe-vlm-tiny", "--device", "cpu")
# what every checkpoint saved under the old default holds in its settings
OLD_DEFAULT = ("--set", "projection=affine", "--set", "projection_norm=false")


def test_every_variant_defaults_to_the_exportable_projector_and_affine_is_one_setting_away():
    hooks = {variant.name: Registry().hooks(variant.name) for variant in VARIANTS}
    for variant in VARIANTS:
        settings = NemotronVLMSettings(**variant.defaults)
        assert (settings.projection, settings.has_projection_norm) == ("mlp", True), variant.name
        assert hooks[variant.name].hf_export_check(settings=settings) == {}, variant.name
    affine = NemotronVLMSettings(projection="affine")  # valid alone: the affine projection has no norm
    assert not affine.has_projection_norm
    assert hooks["nemotron-moe-vlm-20l"].hf_export_check(settings=affine) == {"projection": ("affine", "mlp")}


def test_a_checkpoint_of_the_old_default_resumes_with_its_settings_and_refuses_the_new_default_in_one_line(
        tmp_path):
    saved = tmp_path / "old"
    result = run_mimo(*RUN, *OLD_DEFAULT, "--train-iters", "1", "--save", str(saved), env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = saved / "iter_0000001"

    # asking for the new default on resume is one line naming both values and the run file
    refused = run_mimo(*RUN, "--train-iters", "2", "--load", str(saved), "--set", "projection=mlp", env=ENV)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --set projection=mlp, but {checkpoint} was saved with "
                                                   f"projection=affine ({checkpoint}/run.yaml"), lines

    # a plain resume takes the checkpoint's settings (affine), as does its run file
    for extra in ((), ("--config", str(checkpoint / "run.yaml"))):
        resumed = run_mimo(*(extra and ("run",) + extra or RUN), "--train-iters", "2", "--load", str(saved),
                           "--save", str(tmp_path / f"more{len(extra)}"), env=ENV)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "iteration        2" in resumed.stdout or "iteration 2" in resumed.stdout, resumed.stdout[-2000:]
