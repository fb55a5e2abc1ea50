"""The Nemotron provider's te backend against transformers' references, on a GPU (fp32): a tiny random NemotronH
(Mamba, MoE, attention and MLP layers) and a tiny random C-RADIO, loaded strictly into the te-backend modules through
the tensor maps of mimo.providers.nemotron.hf (the per-rank loader: te's keys are local's), and run on the same inputs. Prints the max relative errors (target <= 1e-4).

    NVIDIA_TF32_OVERRIDE=0 python scripts/gpu/hf_te_parity.py   # transformer-engine, mamba-ssm and a GPU

TF32 off: by default transformer-engine's fp32 GEMMs (and mamba-ssm's kernels in the reference) use TF32, which
alone moves the LLM's logits by about 8e-4 relative (docs/verification.md). Both backends are checked.

The CPU tests (tests/unit/test_hf_nemotron_h.py, tests/unit/test_hf_radio.py) check the local backend the same way. The
NemotronH reference clamps the Mamba step size at time_step_min and megatron-core's MambaMixer does not: the step
biases here keep every step above it, so that the comparison is of the kernels, not of that difference.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from megatron.core.transformer.spec_utils import build_module

from mimo.core.checkpoint.hf import check_folder
from mimo.core.checkpoint.hf_load import load_into
from mimo.core.parallel import layout, topology
from mimo.core.config import LayoutOptions
from mimo.core.run.launch import seed_everything
from mimo.plugins import BuildContext
from mimo.providers.nemotron.hf import nemotron_h, radio
from mimo.plugins.kit.safetensors_io import FolderSource
from mimo.providers import nemotron
from mimo.providers.nemotron import ENCODER, IMAGES, TINY, NemotronVLMSettings

TOLERANCE = 1e-4
PATTERN = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe", "full_attention"]


def relative_error(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def randomize(model, dt_bias=(-4.0, -2.0)) -> None:
    """Every parameter away from its initial value; softplus(dt_bias) >= 0.018, above time_step_min (0.001).
    Buffers (RADIO's input statistics) and RADIO's LayerScale (the identity in C-RADIO) stay."""
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "lambda1" in name:
                continue
            if name.endswith("dt_bias"):
                tensor.uniform_(*dt_bias)
            elif name.endswith(("norm.weight", "norm_f.weight", ".D")):
                tensor.uniform_(0.5, 1.5)
            elif tensor.is_floating_point():
                tensor.normal_(0.0, 0.05)


def saved(model) -> tuple[dict, FolderSource]:
    """(config.json, the folder's reader) as `save_pretrained` writes them: the maps read the files' names."""
    folder = Path(tempfile.mkdtemp())
    model.save_pretrained(folder)
    return json.loads((folder / "config.json").read_text()), FolderSource(folder)


def module_context(settings):
    parallelism = layout.plan(LayoutOptions(), 1, nemotron.model_shape(settings), micro_batch_size=1)
    topo = topology.build(parallelism, backend="nccl")
    seed_everything(0, tp_rank=0, ep_rank=0, etp_rank=0)
    return BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)


def load_strictly(module, tmap, source) -> None:
    """Every tensor of the module through its map, nothing left at initialization or over (a module outside mimo's
    model wrapper: its data-parallel world is this process)."""
    check_folder("the reference", tmap, source)
    _, initial, errors = load_into(module, [(tmap, source)], {"dp_cp_group": None})
    assert not initial and not errors, (initial, errors)


def language_model_parity(backend: str = "te") -> float:
    config = transformers.NemotronHConfig(
        vocab_size=96, hidden_size=64, layers_block_type=PATTERN, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16,
        conv_kernel=4, chunk_size=16, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=40, routed_scaling_factor=2.5, dtype="float32")
    torch.manual_seed(0)
    reference = transformers.NemotronHForCausalLM(config).eval()
    randomize(reference)
    hf_config, hf_state = saved(reference)
    # the te backend has no step clamp (megatron-core's MambaMixer); the weights above never reach it
    fields = {**nemotron_h.config_fields(hf_config), "mamba_dt_clamp_min": 0.0}
    settings = NemotronVLMSettings(**{**TINY, **fields, "backend": backend})
    model = build_module(nemotron.build_language_model(settings, module_context(settings))).cuda().eval()
    load_strictly(model, nemotron_h.tensor_map(fields), hf_state)
    input_ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        want = reference.cuda()(input_ids).logits
        got = model(input_ids, position_ids=None, attention_mask=None)
    return relative_error(got, want)


def radio_parity(backend: str = "te") -> float:
    config = transformers.RadioConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=16,
                                      image_size=64, max_img_size=256, num_cls_tokens=2, num_registers=2)
    torch.manual_seed(0)
    reference = transformers.RadioModel(config).eval()
    randomize(reference)
    hf_config, hf_state = saved(reference)
    settings = NemotronVLMSettings(**{**TINY, **radio.config_fields(hf_config), "pixel_shuffle": False,
                                      "seq_length": 256, "backend": backend, "dynamic_resolution": False,
                                      "image_size": 64})
    spec = nemotron.build_encoders(settings, module_context(settings))[IMAGES].spec
    encoder = build_module(spec.submodules["encoders"][ENCODER]).cuda().eval()
    load_strictly(encoder, radio.tensor_map(settings, hf_config), hf_state)
    return _radio_features_error(reference.cuda(), encoder, settings)


def _radio_features_error(reference, encoder, settings) -> float:
    from mimo.providers.nemotron.data import image_mode

    image = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(2))
    inputs = image_mode(settings).collate([image_mode(settings).process(image)])
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad():
        got = encoder(**inputs)
        want = reference(image[None].cuda()).features
    return relative_error(got.reshape(want.shape), want)


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    checks = [(name, check, backend) for backend in ("te", "local")
              for name, check in (("NemotronH logits", language_model_parity), ("RADIO features", radio_parity))]
    for name, check, backend in checks:
        try:
            error = check(backend)
            print(f"{name}, {backend} backend vs transformers {transformers.__version__}: max relative error "
                  f"{error:.2e} ({'within' if error <= TOLERANCE else 'ABOVE'} {TOLERANCE:g})", flush=True)
        except Exception as err:  # noqa: BLE001 - report each check, go on to the next
            print(f"{name}: failed: {type(err).__name__}: {err}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
