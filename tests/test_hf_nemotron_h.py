"""Hugging Face NemotronH <-> the Nemotron provider's language model (providers/nemotron/hf/nemotron_h.py), proven against
transformers' reference implementation: a tiny random NemotronHForCausalLM with every layer kind (Mamba, MoE,
attention, MLP) is saved, read back through safetensors_io, converted, loaded into mimo's HybridModel (local
backend), and both compute the same logits; converted back and saved, transformers loads the same bits."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import world_of_one
from megatron.core.transformer.spec_utils import build_module
from mimo.core.parallel import topology
from mimo.core.config import LayoutOptions
from mimo.core.run.launch import seed_everything
from mimo.errors import UsageError
from mimo.plugins import BuildContext
from mimo.providers.nemotron.hf import nemotron_h
from mimo.plugins.kit import safetensors_io
from mimo.providers import nemotron
from mimo.providers.nemotron import TINY, NemotronVLMSettings
from mimo.providers.nemotron.counts import parameter_counts
from mimo.providers.nemotron.mamba_mixer import LocalMambaMixer

PATTERN = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe", "full_attention"]  # M E * -
MAX_RELATIVE_ERROR = 1e-4  # of the logits, relative to their largest magnitude; measured: about 4e-7


def _reference_model():
    """A tiny NemotronH whose every tensor is random and away from its initial value (norm weights, D, the
    expert bias...), with step-size biases that put some heads' dt below time_step_min, where the reference
    clamps it. Mamba chunks of 16 (mimo's mixer uses 128: the chunking must not change the function)."""
    config = transformers.NemotronHConfig(
        vocab_size=96, hidden_size=64, layers_block_type=PATTERN, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16,
        conv_kernel=4, chunk_size=16, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=40, routed_scaling_factor=2.5, time_step_min=0.001,
        dtype="float32")
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("dt_bias"):
                tensor.uniform_(-9.0, -2.0)  # softplus: 1.2e-4 .. 0.13, about a third of the heads clamped
            elif name.endswith(("norm.weight", "norm_f.weight", ".D")):
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.1)
            else:
                tensor.normal_(0.0, 0.1 if name.endswith(("A_log", "conv1d.bias")) else 0.05)
    return model


def _language_model(fields: dict):
    """mimo's language model (local backend, fp32) for the converted settings, built through the provider's hook
    in a world of one; its parameters are as many as the provider's analytic count says."""
    settings = NemotronVLMSettings(**{**TINY, **fields, "backend": "local"})
    parallelism = topology.plan(LayoutOptions(), 1, nemotron.model_shape(settings), micro_batch_size=1)
    topo = topology.build(parallelism, backend="gloo")
    seed_everything(0, tp_rank=0, ep_rank=0, etp_rank=0)
    ctx = BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)
    model = build_module(nemotron.build_language_model(settings, ctx)).eval()
    assert sum(p.numel() for p in model.parameters()) == parameter_counts(settings)["language"].total
    return model


def _load_strictly(model, state: dict) -> None:
    """load_state_dict, refusing any unexpected or missing tensor; only the linears' `_extra_state` (empty, no
    tensors) may be absent."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(name.endswith("._extra_state") for name in missing), missing


def _max_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _saved(model, folder):
    model.save_pretrained(folder, max_shard_size="200KB")  # sharded, with the index
    assert (folder / safetensors_io.INDEX_FILE).exists()
    return model, folder


@pytest.fixture(scope="module")
def saved_reference(tmp_path_factory):
    return _saved(_reference_model(), tmp_path_factory.mktemp("nemotron_h"))


def test_mimo_computes_the_reference_logits_and_exports_the_same_bits(saved_reference, tmp_path):
    reference, folder = saved_reference
    hf_config = safetensors_io.read_config(folder)
    hf_state = safetensors_io.SafetensorsFolder(folder)
    fields = nemotron_h.config_fields(hf_config)
    assert fields["hybrid_pattern"] == "ME*-ME*" and fields["mamba_dt_clamp_min"] == 0.001

    input_ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(input_ids).logits
    with world_of_one():
        model = _language_model(fields)
        _load_strictly(model, nemotron_h.to_megatron(hf_state, hf_config))
        with torch.no_grad():
            got = model(input_ids, position_ids=None, attention_mask=None)
            error = _max_relative_error(got, want)
            assert got.shape == want.shape and error <= MAX_RELATIVE_ERROR, error
            # The step-size clamp is needed: without it the function differs.
            for mixer in (m for m in model.modules() if isinstance(m, LocalMambaMixer)):
                mixer.dt_limit = (0.0, float("inf"))
            assert _max_relative_error(model(input_ids, position_ids=None, attention_mask=None), want) > 100 * error
        exported = nemotron_h.from_megatron(model.state_dict(), hf_config)

    assert exported.keys() == hf_state.keys()
    assert all(torch.equal(exported[name], hf_state[name]) for name in hf_state)  # bit for bit
    safetensors_io.save(tmp_path / "export", exported, hf_config, max_shard_bytes=100_000)
    reloaded = transformers.NemotronHForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    original = reference.state_dict()
    assert reloaded.keys() == original.keys()
    for name, tensor in original.items():
        assert reloaded[name].dtype == tensor.dtype and torch.equal(reloaded[name], tensor), name


def test_round_trips_are_bit_identical_in_both_expert_layouts_and_from_a_loaded_model(saved_reference):
    reference, folder = saved_reference
    hf_config, hf_state = safetensors_io.read_config(folder), safetensors_io.SafetensorsFolder(folder)
    for experts in ("sequential", "grouped"):
        state = nemotron_h.to_megatron(hf_state, hf_config, experts=experts)
        assert ("decoder.layers.1.mlp.experts.linear_fc1.weight5" in state) == (experts == "grouped")
        back = nemotron_h.from_megatron(state, hf_config)
        assert back.keys() == hf_state.keys() and all(torch.equal(back[n], hf_state[n]) for n in hf_state)
    # A loaded model's own state dict (model. prefix, stacked experts) converts to the same tensors.
    from_model = nemotron_h.to_megatron(reference.state_dict(), hf_config)
    from_files = nemotron_h.to_megatron(hf_state, hf_config)
    assert from_model.keys() == from_files.keys()
    assert all(torch.equal(from_model[n], from_files[n]) for n in from_files)


def test_qkv_rows_are_interleaved_per_key_value_group():
    d, hidden = 2, 3
    q, k, v = (torch.full((n * d, hidden), float(i)) for i, n in enumerate((4, 2, 2)))  # 4 heads, 2 groups
    q += torch.arange(4 * d)[:, None] * 10  # q rows told apart
    fields = dict(num_query_groups=2, kv_channels=d, num_attention_heads=4)
    qkv = nemotron_h._fuse_qkv(q, k, v, fields)
    rows = qkv[:, 0].tolist()
    assert rows == [0, 10, 20, 30, 1, 1, 2, 2, 40, 50, 60, 70, 1, 1, 2, 2]  # [q heads 0-1, k0, v0, q 2-3, k1, v1]
    assert all(torch.equal(a, b) for a, b in zip(nemotron_h._split_qkv(qkv, fields), (q, k, v)))


@pytest.mark.parametrize("field, value", [
    ("mlp_hidden_act", "silu"), ("n_group", 2), ("moe_latent_size", 16), ("layer_norm_epsilon", 1e-6),
    ("norm_topk_prob", False), ("num_experts_per_tok", 1), ("use_bias", True),
])
def test_an_unsupported_config_value_is_one_line_naming_the_field(saved_reference, field, value):
    hf_config = {**safetensors_io.read_config(saved_reference[1]), field: value}
    with pytest.raises(UsageError) as err:
        nemotron_h.config_fields(hf_config)
    message = str(err.value)
    assert "\n" not in message and f"{field}={value!r}" in message, message


def test_conversion_refuses_tensors_the_config_does_not_describe(saved_reference):
    hf_config, hf_state = safetensors_io.read_config(saved_reference[1]), dict(safetensors_io.SafetensorsFolder(
        saved_reference[1]))
    with pytest.raises(UsageError, match="has tensors the config does not describe: backbone.extra"):
        nemotron_h.to_megatron({**hf_state, "backbone.extra": torch.zeros(1)}, hf_config)
    del hf_state["backbone.layers.2.mixer.k_proj.weight"]
    with pytest.raises(UsageError, match="has no backbone.layers.2.mixer.k_proj.weight"):
        nemotron_h.to_megatron(hf_state, hf_config)


def test_the_te_backend_refuses_the_step_size_clamp_the_local_mixer_applies():
    from mimo.providers.nemotron import specs

    local = specs.hybrid_stack_spec("local", 4, 8, 0.001).submodules.mamba_layer.submodules.mixer
    assert local.params["dt_limit"] == (0.001, float("inf"))
    with pytest.raises(ValueError, match="mamba_dt_clamp_min 0.001: megatron-core's MambaMixer .* does not clamp"):
        specs.hybrid_stack_spec("te", 4, 8, 0.001)


def test_safetensors_folder_single_file_shared_memory_and_no_overwrite(tmp_path):
    stacked = torch.arange(12.0).reshape(3, 4)
    tensors = {"a": stacked, "first_row": stacked[0], "half": torch.ones(2).half()}
    safetensors_io.save(tmp_path, tensors, {"model_type": "x"})  # overlapping memory, which safetensors refuses
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    back = safetensors_io.SafetensorsFolder(tmp_path)
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[n], t) and back[n].dtype == t.dtype
                                                   for n, t in tensors.items())
    assert safetensors_io.read_config(tmp_path) == {"model_type": "x"}
    with pytest.raises(UsageError, match="already holds a checkpoint"):
        safetensors_io.save(tmp_path, tensors, {})
