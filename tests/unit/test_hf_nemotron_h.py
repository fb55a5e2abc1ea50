"""Hugging Face NemotronH <-> the Nemotron provider's language model (providers/nemotron/hf/nemotron_h.py), proven against
transformers' reference implementation: a tiny random NemotronHForCausalLM with every layer kind (Mamba, MoE,
attention, MLP) is saved (sharded), loaded through its tensor map into mimo's HybridModel (local backend) by the
per-rank loader, and both compute the same logits; exported back through the same map, transformers loads the same
bits. Also the slice reader and shard writer (mimo.plugins.kit.safetensors_io)."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import world_of_one
from megatron.core.transformer.spec_utils import build_module
from mimo.core.checkpoint.hf import check_folder
from mimo.core.checkpoint.hf_load import global_tensors, load_into
from mimo.core.parallel import layout, topology
from mimo.core.config import LayoutOptions
from mimo.core.run.launch import seed_everything
from mimo.errors import UsageError
from mimo.plugins import BuildContext
from mimo.providers.nemotron.hf import nemotron_h
from mimo.plugins.kit import safetensors_io
from mimo.plugins.kit.safetensors_io import FolderSource, TensorsSource
from mimo.plugins.kit.tensor_map import TensorMap, to_hf
from mimo.providers import nemotron
from mimo.providers.nemotron import TINY, NemotronVLMSettings
from mimo.providers.nemotron.counts import parameter_counts
from mimo.providers.nemotron.mamba_mixer import LocalMambaMixer

PATTERN = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe", "full_attention"]  # M E * -
ALONE = {"dp_cp_group": None}  # a module outside mimo's model wrapper: its world is this process (set in tests)
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
    parallelism = layout.plan(LayoutOptions(), 1, nemotron.model_shape(settings), micro_batch_size=1)
    topo = topology.build(parallelism, backend="gloo")
    seed_everything(0, tp_rank=0, ep_rank=0, etp_rank=0)
    ctx = BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)
    model = build_module(nemotron.build_language_model(settings, ctx)).eval()
    assert sum(p.numel() for p in model.parameters()) == parameter_counts(settings)["language"].total
    return model


def _load(model, tmap, source) -> None:
    """Every tensor of the model from `source` through `tmap`, nothing left at initialization, nothing left over."""
    check_folder("the folder", tmap, source)
    read, initial, errors = load_into(model, [(tmap, source)], ALONE)
    assert not initial and not errors, (initial, errors)


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
    fields = nemotron_h.config_fields(hf_config)
    assert fields["hybrid_pattern"] == "ME*-ME*" and fields["mamba_dt_clamp_min"] == 0.001
    tmap = nemotron_h.tensor_map(fields)

    input_ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(input_ids).logits
    with world_of_one():
        model = _language_model(fields)
        with FolderSource(folder) as source:
            _load(model, tmap, source)
            assert source.meter.bytes == sum(t.numel() * t.element_size() for t in reference.state_dict().values())
        with torch.no_grad():
            got = model(input_ids, position_ids=None, attention_mask=None)
            error = _max_relative_error(got, want)
            assert got.shape == want.shape and error <= MAX_RELATIVE_ERROR, error
            # The step-size clamp is needed: without it the function differs.
            for mixer in (m for m in model.modules() if isinstance(m, LocalMambaMixer)):
                mixer.dt_limit = (0.0, float("inf"))
            assert _max_relative_error(model(input_ids, position_ids=None, attention_mask=None), want) > 100 * error
        exported = to_hf(tmap, global_tensors(model, ALONE))

    with FolderSource(folder) as source:
        assert sorted(exported) == sorted(source.names())
        assert all(torch.equal(exported[name], source.read(name)) for name in exported)  # bit for bit
    safetensors_io.save(tmp_path / "export", exported, hf_config, max_shard_bytes=100_000)
    reloaded = transformers.NemotronHForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    original = reference.state_dict()
    assert reloaded.keys() == original.keys()
    for name, tensor in original.items():
        assert reloaded[name].dtype == tensor.dtype and torch.equal(reloaded[name], tensor), name


def test_qkv_rows_are_interleaved_per_key_value_group():
    d, hidden = 2, 3
    q, k, v = (torch.full((n * d, hidden), float(i)) for i, n in enumerate((4, 2, 2)))  # 4 heads, 2 groups
    q += torch.arange(4 * d)[:, None] * 10  # q rows told apart
    fields = dict(hybrid_pattern="*", num_query_groups=2, kv_channels=d, num_attention_heads=4)
    tmap = nemotron_h.tensor_map(fields)
    key, prefix = "decoder.layers.0.self_attention.linear_qkv.weight", "backbone.layers.0.mixer."
    source = TensorsSource({f"{prefix}{p}_proj.weight": t for p, t in zip("qkv", (q, k, v))})
    qkv = torch.empty(16, hidden)
    from mimo.plugins.kit.tensor_map import read_into

    read_into(tmap.tensors[key], ((0, 16), (0, hidden)), qkv, source)
    assert qkv[:, 0].tolist() == [0, 10, 20, 30, 1, 1, 2, 2, 40, 50, 60, 70, 1, 1, 2, 2]  # [q 0-1, k0, v0, q 2-3, k1, v1]
    half = torch.empty(8, hidden)  # the second TP rank's rows: group 1 alone
    read_into(tmap.tensors[key], ((8, 16), (0, hidden)), half, source)
    assert torch.equal(half, qkv[8:])
    back = to_hf(TensorMap({key: tmap.tensors[key]}), {key: qkv})
    assert all(torch.equal(back[f"{prefix}{p}_proj.weight"], t) for p, t in zip("qkv", (q, k, v)))


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


def test_a_folder_with_tensors_the_config_does_not_describe_is_one_line(saved_reference):
    folder = saved_reference[1]
    tmap = nemotron_h.tensor_map(nemotron_h.config_fields(safetensors_io.read_config(folder)))
    with FolderSource(folder) as source:
        tensors = {name: source.read(name) for name in source.names()}
    with pytest.raises(UsageError, match="has tensor backbone.extra, which the model has no place for"):
        check_folder("DIR", tmap, TensorsSource({**tensors, "backbone.extra": torch.zeros(1)}))
    del tensors["backbone.layers.2.mixer.k_proj.weight"]
    with pytest.raises(UsageError, match="^DIR has no tensor backbone.layers.2.mixer.k_proj.weight, which"):
        check_folder("DIR", tmap, TensorsSource(tensors))


def test_the_te_backend_refuses_the_step_size_clamp_the_local_mixer_applies():
    from mimo.providers.nemotron import specs

    local = specs.hybrid_stack_spec("local", 4, 8, 0.001).submodules.mamba_layer.submodules.mixer
    assert local.params["dt_limit"] == (0.001, float("inf"))
    with pytest.raises(ValueError, match="mamba_dt_clamp_min 0.001: megatron-core's MambaMixer .* does not clamp"):
        specs.hybrid_stack_spec("te", 4, 8, 0.001)


def test_the_slice_reader_reads_only_what_is_asked_and_the_writer_shards(tmp_path):
    """Row and column windows, casts and scalars read from a sharded folder as the reference slices them; the
    reader counts every byte it delivers; the writer's shards and index load back; a folder holding a checkpoint
    is not written over."""
    generator = torch.Generator().manual_seed(0)
    tensors = {"rows": torch.randn(40, 8, generator=generator), "cols": torch.randn(6, 50, generator=generator),
               "experts": torch.randn(4, 6, 5, generator=generator).bfloat16(), "scalar": torch.tensor(2.5),
               "index": torch.arange(5)}
    safetensors_io.save(tmp_path, tensors, {"model_type": "x"}, max_shard_bytes=1000)
    assert (tmp_path / safetensors_io.INDEX_FILE).exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    assert oct((tmp_path / "config.json").stat().st_mode & 0o777) == "0o644"
    cases = [("rows", ((10, 30), (0, 8))), ("cols", ((0, 6), (25, 50))), ("experts", ((2, 4), (0, 6), (0, 5))),
             ("experts", ((1, 2), (0, 6), (2, 4))), ("scalar", ()), ("index", ((1, 4),))]
    with FolderSource(tmp_path, chunk_bytes=64) as source:  # column reads in blocks of a row or two
        for name, index in cases:
            want = tensors[name][tuple(slice(a, b) for a, b in index)]
            got = torch.empty(want.shape, dtype=torch.float64)  # a cast on the way
            source.read_into(name, index, got)
            assert torch.equal(got, want.double()), (name, index)
        assert source.meter.bytes == sum(tensors[n][tuple(slice(a, b) for a, b in i)].numel() *
                                         tensors[n].element_size() for n, i in cases)
        assert source.meter.whole == ["scalar"]
        assert source.meter.disk > source.meter.bytes  # the column slice read whole rows
    with pytest.raises(UsageError, match="already holds a checkpoint"):
        safetensors_io.save(tmp_path, tensors, {})
