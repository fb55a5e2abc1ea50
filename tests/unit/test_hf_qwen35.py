"""Hugging Face Qwen3.5 <-> the qwen3.5-vl providers' language model (providers/qwen35/hf/), proven against
transformers' reference implementation: tiny random `Qwen3_5ForConditionalGeneration` and
`Qwen3_5MoeForConditionalGeneration` models (both layer kinds: gated delta net and gated full attention) are saved
(sharded), their language model loaded through the provider's hf_settings / hf_tensor_map hooks (part
"language", `--pretrained-llm`) into mimo's language model (local backend, fp32) by the per-rank loader, and both
compute the same teacher-forced logits of text token ids. The whole VLM, images included, and its export:
test_hf_qwen35_vlm.py."""

from __future__ import annotations

import pytest
import torch

from helpers import world_of_one
from megatron.core.transformer.spec_utils import build_module
from mimo.core.checkpoint.hf import check_folder
from mimo.core.checkpoint.hf_load import load_into
from mimo.core.config import LayoutOptions
from mimo.core.parallel import layout, topology
from mimo.core.run.launch import seed_everything
from mimo.errors import UsageError
from mimo import LANGUAGE, module_prefix
from mimo.plugins import BuildContext
from mimo.plugins.kit.tensor_map import TensorMap
from mimo.plugins.kit import safetensors_io
from mimo.plugins.kit.safetensors_io import FolderSource
from mimo.providers import qwen35
from mimo.providers.qwen35 import Qwen35Settings
from mimo.providers.qwen35.counts import parameter_counts
from qwen35_models import TEXT, TOKENS, VISION, save_reference

ALONE = {"dp_cp_group": None}
MAX_RELATIVE_ERROR = 1e-4  # of the logits, relative to their largest magnitude


def _language_model(fields: dict):
    """mimo's language model (local backend, fp32) for the converted settings, built through the provider's hook
    in a world of one; as many parameters as the provider's count says."""
    settings = Qwen35Settings(**{**fields, "backend": "local", "seq_length": 64})
    parallelism = layout.plan(LayoutOptions(), 1, qwen35.model_shape(settings), micro_batch_size=1)
    topo = topology.build(parallelism, backend="gloo")
    seed_everything(0, tp_rank=0, ep_rank=0, etp_rank=0)
    ctx = BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)
    model = build_module(qwen35.build_language_model(settings, ctx)).eval()
    assert sum(p.numel() for p in model.parameters()) == parameter_counts(settings).total
    return settings, model


def _unprefixed(tmap):
    """The hook's map (keys of the MimoModel) for the language model built alone."""
    prefix = module_prefix(LANGUAGE)
    assert all(key.startswith(prefix) for key in tmap.tensors)
    return TensorMap({k.removeprefix(prefix): v for k, v in tmap.tensors.items()}, ("",), tmap.checks, tmap.ignored)


def _max_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("moe, tied", [(False, False), (True, False), (False, True)], ids=["dense", "moe", "tied"])
def test_mimo_computes_the_reference_logits(tmp_path, moe, tied):
    reference, folder = save_reference(tmp_path, moe, tied=tied)
    hf_config = safetensors_io.read_config(folder)
    fields = qwen35.hf_settings(hf_config=hf_config, part="language")
    assert fields["layer_pattern"] == "GG*G" and fields["num_experts"] == (4 if moe else 0)
    assert fields["tie_word_embeddings"] == tied
    input_ids = torch.randint(0, 264, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(input_ids=input_ids).logits
    with world_of_one():
        settings, model = _language_model(fields)
        tmap = _unprefixed(qwen35.hf_tensor_map(settings=settings, hf_config=hf_config, part="language"))
        with FolderSource(folder) as source:
            check_folder("the folder", tmap, source)
            read, initial, errors = load_into(model, [(tmap, source)], ALONE)
            assert not initial and not errors, (initial, errors)
        positions = torch.arange(40).expand(2, 40)
        with torch.no_grad():
            got = model(input_ids, position_ids=positions, attention_mask=None)
        error = _max_relative_error(got, want)
        assert got.shape == want.shape and error <= MAX_RELATIVE_ERROR, error


def test_the_language_model_alone_reads_a_causal_lm_folder(tmp_path):
    """`--pretrained-llm DIR`: a Qwen3_5ForCausalLM folder (model_type qwen3_5_text, tensors under `model.`)."""
    import transformers

    config = transformers.Qwen3_5TextConfig(**TEXT)
    torch.manual_seed(3)
    reference = transformers.Qwen3_5ForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    hf_config = safetensors_io.read_config(tmp_path)
    fields = qwen35.hf_settings(hf_config=hf_config, part="language")
    input_ids = torch.randint(0, 264, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference(input_ids=input_ids).logits
    with world_of_one():
        settings, model = _language_model(fields)
        tmap = _unprefixed(qwen35.hf_tensor_map(settings=settings, hf_config=hf_config, part="language"))
        with FolderSource(tmp_path) as source:
            _, initial, errors = load_into(model, [(tmap, source)], ALONE)
            assert not initial and not errors, (initial, errors)
        with torch.no_grad():
            got = model(input_ids, position_ids=torch.arange(24)[None], attention_mask=None)
        assert _max_relative_error(got, want) <= MAX_RELATIVE_ERROR


def test_interleaved_mrope_gives_transformers_frequencies_for_3d_positions():
    """Image positions differ per axis: the rotary module lays the temporal, height and width frequencies out as
    transformers' Qwen3.5 does (interleaved), not as megatron-core's sectioned MRoPE."""
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from mimo.providers.qwen35.layers import InterleavedMRoPE

    text = {**TEXT, "head_dim": 64, "rope_parameters": {**TEXT["rope_parameters"], "partial_rotary_factor": 1.0,
                                                         "mrope_section": [11, 11, 10]}}
    reference = Qwen3_5TextRotaryEmbedding(transformers.Qwen3_5TextConfig(**text))
    positions = torch.randint(0, 50, (3, 2, 7), generator=torch.Generator().manual_seed(0))
    cos, _ = reference(torch.zeros(1, dtype=torch.float32), positions)  # [B, S, 64]
    with world_of_one():
        ours = InterleavedMRoPE(kv_channels=64, rotary_percent=1.0, rotary_base=10000)
        emb = ours(positions, [11, 11, 10])  # [S, B, 1, 64]
        assert torch.allclose(emb[:, :, 0].transpose(0, 1).cos(), cos, atol=1e-6)
        sectioned = super(InterleavedMRoPE, ours).forward(positions, [11, 11, 10])
        assert not torch.allclose(sectioned[:, :, 0].transpose(0, 1).cos(), cos, atol=1e-3)
        # text positions [B, S] are every axis alike
        flat = positions[0]
        assert torch.equal(ours(flat, [11, 11, 10]), ours(flat.expand(3, -1, -1), [11, 11, 10]))


@pytest.mark.parametrize("field, value", [("hidden_act", "gelu"), ("attention_bias", True)])
def test_an_unsupported_config_value_is_one_line_naming_the_field(field, value):
    hf_config = {"model_type": "qwen3_5", "text_config": {**TEXT, "model_type": "qwen3_5_text", field: value}}
    with pytest.raises(UsageError) as err:
        qwen35.hf_settings(hf_config=hf_config, part="model")
    assert "\n" not in str(err.value) and f"{field}={value!r}" in str(err.value)


def test_a_text_model_folder_is_the_language_model_and_a_vlm_folder_each_part():
    """A Qwen3_5ForCausalLM folder has no vision tower: `--pretrained-llm` reads it, `--pretrained` (the whole VLM)
    does not. A VLM folder gives each part its own keys: the language model's, the vision tower's and merger's."""
    config = {**TEXT, "model_type": "qwen3_5_text"}
    assert qwen35.hf_settings(hf_config=config, part="model") is None
    fields = qwen35.hf_settings(hf_config=config, part="language")
    assert fields["layer_pattern"] == "GG*G"
    vlm = {"model_type": "qwen3_5", "text_config": {**TEXT, "model_type": "qwen3_5_text"},
           "vision_config": {**VISION, "model_type": "qwen3_5_vision"}, **TOKENS}
    whole = qwen35.hf_settings(hf_config=vlm, part="model")
    assert whole == {**fields, **qwen35.hf_settings(hf_config=vlm, part="vision")}
    settings = Qwen35Settings(**whole)
    maps = {p: qwen35.hf_tensor_map(settings=settings, hf_config=vlm, part=p) for p in ("model", "language", "vision")}
    assert all(k.startswith("language_model.") for k in maps["language"].tensors)
    assert all(k.startswith("modality_submodules.images.") for k in maps["vision"].tensors)
    assert maps["model"].tensors == {**maps["language"].tensors, **maps["vision"].tensors}
    assert "modality_submodules.images.input_projections.0.encoder.linear_fc1.weight" in maps["vision"].tensors
