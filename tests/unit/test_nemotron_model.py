"""The Nemotron MoE VLM providers (providers/nemotron): settings and variants, analytic parameter counts against
built models, the local backend's modules (THD attention, fused norm-linear) against plain references, the
encoder's token layout against the data's placeholders, and the local specs against megatron-core's TE specs."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from helpers import world_of_one
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.models.mimo import MimoModel, MimoModelConfig
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from mimo.core.parallel import layout, topology
from mimo.core.config import LayoutOptions
from mimo.core.run.launch import seed_everything
from mimo.errors import UsageError
from mimo.plugins import BuildContext, DataContext
from mimo.providers import nemotron
from mimo.providers.nemotron import IMAGES, TINY, VARIANTS, NemotronVLMSettings
from mimo.plugins import SDPAttention
from mimo.providers.nemotron.counts import parameter_counts
from mimo.providers.nemotron.data import SyntheticTask, synthetic_batches
from mimo.providers.nemotron.layers import LayerNormColumnParallelLinear
from mimo.providers.nemotron.model import pixel_shuffle
from mimo.providers.nemotron.settings import PATTERN_20L, PATTERN_54L

# --------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def world():
    """A world of one (gloo); process groups come from mimo's topology, as in a run."""
    with world_of_one():
        yield


def build(seed: int = 0, **overrides):
    """(settings, MimoModel) of the tiny variant with `overrides`, built through the provider's hooks."""
    settings = NemotronVLMSettings(**{**TINY, **overrides})
    parallelism = layout.plan(LayoutOptions(), 1, nemotron.model_shape(settings), micro_batch_size=1)
    topo = topology.build(parallelism, backend="gloo")
    seed_everything(seed, tp_rank=0, ep_rank=0, etp_rank=0)
    ctx = BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)
    encoder = nemotron.build_encoders(settings, ctx)[IMAGES]
    config = MimoModelConfig(
        language_model_spec=nemotron.build_language_model(settings, ctx),
        modality_submodules_spec={IMAGES: encoder.spec},
        special_token_ids={IMAGES: encoder.placeholder_token_id}, module_to_grid_map=topo.grids)
    return settings, MimoModel(config)


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


# ------------------------------------------------------------------------------------- settings, variants


def test_variants_share_one_settings_class_and_differ_only_in_defaults():
    assert [v.name for v in VARIANTS] == ["nemotron-moe-vlm-20l", "nemotron-moe-vlm-54l", "nemotron-moe-vlm-52l",
                                          "nemotron-moe-vlm-mid", "nemotron-moe-vlm-tiny"]
    assert {v.settings for v in VARIANTS} == {NemotronVLMSettings}
    big20, big54 = (NemotronVLMSettings(**v.defaults) for v in VARIANTS[:2])
    assert big20.hybrid_pattern == PATTERN_20L and big54.hybrid_pattern == PATTERN_54L
    assert dataclasses.replace(big20, hybrid_pattern=PATTERN_54L) == big54  # nothing else differs
    mid = NemotronVLMSettings(**VARIANTS[3].defaults)
    assert mid.hybrid_pattern == PATTERN_20L and mid.hidden_size < big20.hidden_size
    assert mid.num_experts < big20.num_experts


@pytest.mark.parametrize("overrides, message", [
    ({"hybrid_pattern": "MEX*"}, "must be made of M (Mamba), E (MoE) and * (attention)"),
    ({"moe_router_topk": 5}, "moe_router_topk 5 must be at most num_experts 4"),
    ({"image_size": 40}, "image_size 40 is not a multiple of 32"),
    ({"max_patches": 2000}, "need 1 <= min_patches <= max_patches <= 256"),
    ({"seq_length": 16}, "an image can take 16 tokens, which leaves no text in seq_length 16"),
    ({"image_token_id": 264}, "image_token_id 264 is outside the vocabulary of 264"),
])
def test_settings_are_checked(overrides, message):
    with pytest.raises(ValueError) as err:
        NemotronVLMSettings(**{**TINY, **overrides})
    assert message in str(err.value)


@pytest.mark.parametrize("assignment, message", [
    ("num_query_groups=3", "'num_query_groups' of provider 'nemotron-moe-vlm-tiny' is 3: it must divide "
                           "num_attention_heads (4)"),
    ("mamba_num_groups=3", "'mamba_num_groups' of provider 'nemotron-moe-vlm-tiny' is 3: it must divide "
                           "mamba_num_heads (4)"),
    ("vision_heads=3", "it must divide vision_hidden_size (32)"),
    ("class_tokens=-1", "'class_tokens' of provider 'nemotron-moe-vlm-tiny' is -1: it must be at least 0"),
    ("image_probability=1.5", "'image_probability' of provider 'nemotron-moe-vlm-tiny' is 1.5: it must be at most 1.0"),
    ("hidden_size=0", "'hidden_size' of provider 'nemotron-moe-vlm-tiny' is 0: it must be at least 1"),
])
def test_declared_rules_are_checked_before_the_settings_are_built(assignment, message):
    from mimo.plugins.settings import build_settings

    tiny = next(v for v in VARIANTS if v.name == "nemotron-moe-vlm-tiny")
    with pytest.raises(UsageError) as err:
        build_settings(tiny, [assignment])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_training_stages_freeze_through_the_hook(world):
    _, model = build()
    names = [n for n, _ in model.named_parameters()]
    trainable = {}
    for stage in ("stage1", "stage2", "stage3"):
        frozen = nemotron.frozen_parameters(NemotronVLMSettings(**{**TINY, "stage": stage}))
        assert all(any(n.startswith(p) for n in names) for p in frozen), frozen  # every prefix names something
        trainable[stage] = {n.split(".")[0] if n.startswith("language") else ".".join(n.split(".")[:3])
                            for n in names if not any(n.startswith(p) for p in frozen)}
    assert trainable["stage1"] == {"modality_submodules.images.input_projections"}
    assert trainable["stage2"] == {"modality_submodules.images.input_projections", "language_model"}
    assert trainable["stage3"] == trainable["stage2"] | {"modality_submodules.images.encoders"}


def test_the_video_embedder_omni_checkpoints_hold_is_frozen(world):
    settings, model = build(video_temporal_patch_size=2)
    frozen = nemotron.frozen_parameters(settings)
    video = [n for n, _ in model.named_parameters() if "video_embedder" in n]
    assert video and all(any(n.startswith(p) for p in frozen) for n in video)
    others = [n for n, _ in model.named_parameters() if "video_embedder" not in n]
    assert not any(n.startswith(p) for p in frozen for n in others)  # stage3 trains everything else


def test_backend_auto_is_local_without_te_and_te_says_what_is_missing():
    from mimo.providers.nemotron.specs import resolve_backend

    assert resolve_backend("auto") == "local" and resolve_backend("local") == "local"
    with pytest.raises(ValueError, match="backend 'te' needs transformer-engine, mamba-ssm"):
        resolve_backend("te")


# ------------------------------------------------------------------------------------------ parameter counts


def _routed_expert_numel(model) -> int:
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts.local_experts.0")]
    return _numel(experts[0])


@pytest.mark.parametrize("overrides", [
    {},
    # the other choices of every setting the formula branches on
    dict(projection="mlp", class_tokens=0, pixel_shuffle=False, dynamic_resolution=False, image_size=32,
         hybrid_pattern="*EMM*E", num_experts=3, moe_router_topk=1, num_query_groups=4, mamba_conv_kernel=3),
])
def test_analytic_counts_equal_the_built_model(world, overrides):
    settings, model = build(**overrides)
    counts = parameter_counts(settings)
    assert counts[IMAGES].total == counts[IMAGES].active == _numel(model.modality_submodules[IMAGES])
    assert counts["language"].total == _numel(model.language_model)
    # active: every parameter but the routed experts a token is not sent to, in each MoE layer
    unused = settings.hybrid_pattern.count("E") * (settings.num_experts - settings.moe_router_topk)
    assert counts["language"].active == _numel(model.language_model) - unused * _routed_expert_numel(model)
    shape = nemotron.model_shape(settings)
    assert shape["language"].num_parameters == counts["language"].total
    assert shape["language"].num_active_parameters == counts["language"].active
    assert shape[IMAGES].num_parameters == counts[IMAGES].total


def test_the_52_layer_variant_is_the_released_nemotron_3_nano_llm():
    """Published values of NVIDIA-Nemotron-3-Nano-30B-A3B (model card and config): 52 layers, of them 23 Mamba-2,
    23 MoE and 6 attention; 32 query heads and 2 key/value heads of 128; hidden 2688; 128 routed experts of 1856,
    top 6, scaled by 2.5, a shared expert of 3712; Mamba-2 64 heads of 64, 8 groups, state 128; vocabulary 131072;
    about 31.6B parameters, 3.6B of them active per token."""
    s = NemotronVLMSettings(**next(v for v in VARIANTS if v.name == "nemotron-moe-vlm-52l").defaults)
    pattern = s.hybrid_pattern
    assert (len(pattern), pattern.count("M"), pattern.count("E"), pattern.count("*")) == (52, 23, 23, 6)
    assert (s.hidden_size, s.num_attention_heads, s.num_query_groups, s.kv_channels) == (2688, 32, 2, 128)
    assert (s.num_experts, s.moe_router_topk, s.moe_ffn_hidden_size) == (128, 6, 1856)
    assert (s.moe_shared_expert_intermediate_size, s.moe_router_topk_scaling_factor) == (3712, 2.5)
    assert (s.mamba_num_heads, s.mamba_head_dim, s.mamba_num_groups, s.mamba_state_dim) == (64, 64, 8, 128)
    assert s.vocab_size == 131072
    language = nemotron.model_shape(s)["language"]
    assert round(language.num_parameters / 1e9, 1) == 31.6 and round(language.num_active_parameters / 1e9, 1) == 3.6


def test_full_size_counts():
    """20L and 54L from model_shape, against the layer sizes written out by hand for the full architecture."""
    h, vocab = 2688, 131072
    mamba = (h + h * (2 * 4096 + 2 * 8 * 128 + 64) + (4096 + 2048) * 5 + 3 * 64 + 4096 + 4096 * h)
    attention = h + h * (32 + 2 * 8) * 128 + 32 * 128 * h
    moe_always = h + 128 * h + 2 * h * 3712
    expert = 2 * h * 1856
    vit_layer = 2 * 1280 + 1280 * 3840 + 3840 + 1280 * 1280 + 1280 + 2 * 1280 + 1280 * 5120 + 5120 + 5120 * 1280 + 1280
    projection = 5120 + 5120 * 20480 + 20480 * h  # mlp: RMSNorm, fc1, fc2
    vision = 3 * 256 * 1280 + 128 ** 2 * 1280 + 8 * 1280 + 32 * vit_layer + projection
    for variant, (m, e, a) in (("nemotron-moe-vlm-20l", (9, 8, 3)), ("nemotron-moe-vlm-54l", (23, 23, 8))):
        provider = next(v for v in VARIANTS if v.name == variant)
        shape = nemotron.model_shape(NemotronVLMSettings(**provider.defaults))
        base = 2 * vocab * h + h + m * mamba + a * attention + e * moe_always
        assert shape["language"].num_parameters == base + e * 128 * expert
        assert shape["language"].num_active_parameters == base + e * 6 * expert
        assert shape[IMAGES].num_parameters == shape[IMAGES].num_active_parameters == vision
        assert (shape["language"].num_layers, shape["language"].num_query_groups) == (m + e + a, 8)
        assert (shape["language"].num_experts, shape[IMAGES].num_layers) == (128, 32)
    # 54 layers: 31.7B parameters, 3.7B of them active per token; RADIO-H and the mlp projection 0.81B.
    assert round(shape["language"].num_parameters / 1e9, 1) == 31.7 and round(vision / 1e9, 2) == 0.81
    assert round(shape["language"].num_active_parameters / 1e9, 1) == 3.7


# ------------------------------------------------------------------------------------------ local modules


def _attention(heads=4, groups=2, mask=AttnMaskType.no_mask, dropout=0.0):
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = TransformerConfig(num_layers=1, hidden_size=heads * 8, num_attention_heads=heads,
                               num_query_groups=groups, attention_dropout=dropout)
    return SDPAttention(config, 1, mask, "self", pg_collection=ProcessGroupCollection(tp=dist.group.WORLD))


def _reference_attention(q, k, v, causal, key_valid=None):
    """Softmax attention written out: q [b, s, n, d], k/v [b, s, g, d], key_valid [b, s] -> [b, s, n * d]."""
    r = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) / q.shape[-1] ** 0.5
    s = q.shape[1]
    allowed = torch.ones(s, s, dtype=torch.bool).tril() if causal else torch.ones(s, s, dtype=torch.bool)
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bnqk,bknd->bqnd", scores.softmax(-1), v).flatten(2)


@pytest.mark.parametrize("causal", [False, True])
def test_thd_attention_equals_padded_masked_attention(world, causal):
    """Three packed sequences of lengths 3, 7, 5 against the same sequences padded to 7 with a key mask."""
    torch.manual_seed(0)
    lengths, heads, groups, d = [3, 7, 5], 4, 2, 8
    attn = _attention(heads, groups, AttnMaskType.causal if causal else AttnMaskType.no_mask).double()
    q, k, v = (torch.randn(sum(lengths), n, d, dtype=torch.float64, requires_grad=True)
               for n in (heads, groups, groups))
    cu = torch.tensor([0, 3, 10, 15], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    out = attn(q, k, v, None, packed_seq_params=params)  # [t, heads * d]

    def padded(t):
        return torch.stack([F.pad(piece, (0, 0, 0, 0, 0, 7 - len(piece))) for piece in t.split(lengths)])

    valid = torch.stack([torch.arange(7) < n for n in lengths])
    ref = _reference_attention(padded(q), padded(k), padded(v), causal, valid)
    ref = torch.cat([ref[i, :n] for i, n in enumerate(lengths)])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_thd_bounds_are_read_once_per_forward_and_again_after_a_change():
    """Every attention layer of a forward shares one PackedSeqParams: its boundaries cross to the host once (a GPU
    wait each time); RADIO shifts cu_seqlens in place for its class tokens, after which they are read again."""
    from mimo.plugins.kit.attention import _bounds_of

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone())
    first = _bounds_of(params)
    assert first == ([(0, 3), (3, 4)], [(0, 3), (3, 4)]) and _bounds_of(params) is first
    params.cu_seqlens_q.add_(torch.tensor([0, 1, 2], dtype=torch.int32))  # in place, as RADIO does
    assert _bounds_of(params)[0] == [(0, 4), (4, 5)]


def test_thd_padded_boundaries_and_sbhd_with_a_mask(world):
    torch.manual_seed(1)
    attn = _attention(2, 2).double()
    q, k, v = (torch.randn(9, 2, 8, dtype=torch.float64) for _ in range(3))
    # Sequences of 3 and 4 tokens stored at [0, 3) and [4, 8): tokens 3 and 8 are padding and give zeros.
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32),
                             cu_seqlens_kv=torch.tensor([0, 3, 7], dtype=torch.int32),
                             cu_seqlens_q_padded=torch.tensor([0, 4, 9], dtype=torch.int32),
                             cu_seqlens_kv_padded=torch.tensor([0, 4, 9], dtype=torch.int32))
    out = attn(q, k, v, None, packed_seq_params=params)
    assert out[3].abs().max() == 0 and out[8].abs().max() == 0
    second = _reference_attention(q[None, 4:8], k[None, 4:8], v[None, 4:8], causal=False)[0]
    torch.testing.assert_close(out[4:8], second, rtol=1e-10, atol=1e-10)

    # sbhd [s, b, n, d] with megatron's mask convention (True: may not attend), here hiding the last 2 keys
    qs, ks, vs = (torch.randn(6, 2, 2, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    mask[..., 4:] = True
    out = attn(qs, ks, vs, mask)
    valid = torch.arange(6).expand(2, 6) < 4
    ref = _reference_attention(*(t.transpose(0, 1) for t in (qs, ks, vs)), False, valid).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("normalization, zero_centered", [("RMSNorm", False), ("LayerNorm", False),
                                                          ("RMSNorm", True)])
def test_norm_linear_is_a_norm_then_megatrons_linear(world, normalization, zero_centered):
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, normalization=normalization,
                               layernorm_epsilon=1e-5, layernorm_zero_centered_gamma=zero_centered,
                               use_cpu_initialization=True)
    layer = LayerNormColumnParallelLinear(16, 12, config=config, init_method=torch.nn.init.normal_, bias=True,
                                          gather_output=False, tp_group=dist.group.WORLD)
    names = ["weight", "bias", "layer_norm_weight"] + (["layer_norm_bias"] if normalization == "LayerNorm" else [])
    assert sorted(n for n, _ in layer.named_parameters()) == sorted(names)  # TE's LayerNormLinear names
    with torch.no_grad():
        for p in layer.parameters():
            p.uniform_(-1, 1)
    x = torch.randn(5, 2, 16)
    gamma = layer.layer_norm_weight + (1 if zero_centered else 0)
    norm = (torch.nn.functional.rms_norm(x, (16,), gamma, 1e-5) if normalization == "RMSNorm" else
            torch.nn.functional.layer_norm(x, (16,), gamma, layer.layer_norm_bias, 1e-5))
    out, bias = layer(x)
    torch.testing.assert_close(out, norm @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-5)
    assert bias is None


def test_pixel_shuffle_groups_2x2_blocks_in_row_then_column_order():
    rows, cols, c = 4, 6, 3
    grid = torch.arange(rows * cols * c).reshape(rows * cols, c)  # patch (i, j) at row i * cols + j
    out = pixel_shuffle(grid, rows, cols, 2)
    assert out.shape == (rows * cols // 4, 4 * c)
    patch = grid.reshape(rows, cols, c)
    for a in range(rows // 2):
        for b in range(cols // 2):
            expected = torch.cat([patch[2 * a, 2 * b], patch[2 * a, 2 * b + 1],
                                  patch[2 * a + 1, 2 * b], patch[2 * a + 1, 2 * b + 1]])
            assert torch.equal(out[a * (cols // 2) + b], expected)


# ------------------------------------------------------------------------------------ encoder and the data


def test_encoder_tokens_fill_the_placeholders_and_packing_is_per_image(world):
    """Dynamic resolution: the packed micro-batch through RADIO gives one row per placeholder, and each image's
    rows equal what the image gives alone (the THD attention keeps images apart, class tokens per image)."""
    settings, model = build(seed=3)
    model.eval()
    encoder = model.modality_submodules[IMAGES].encoders["radio"]
    task = SyntheticTask(settings)
    samples = [task.sample(seed=0, index=i) for i in range(4)]
    batch = task.collate(samples)
    inputs = batch["modality_inputs"][IMAGES]["radio"]
    cu_before = inputs["packed_seq_params"].cu_seqlens_q.clone()
    with torch.no_grad():
        packed = encoder(**inputs)
        singles = [encoder(**task.collate([sample])["modality_inputs"][IMAGES]["radio"]) for sample in samples]
    assert torch.equal(inputs["packed_seq_params"].cu_seqlens_q, cu_before)  # the caller's copy is untouched
    placeholders = (batch["input_ids"] == task.image_id).sum(1).tolist()
    assert [s.shape[0] for s in singles] == placeholders == [s["clips"][0][0].num_tokens for s in samples]
    assert len(set(placeholders)) > 1  # images of different sizes
    assert packed.shape == (sum(placeholders), 4 * settings.vision_hidden_size)
    torch.testing.assert_close(packed, torch.cat(singles), rtol=1e-4, atol=1e-5)
    assert inputs["x"].shape == (1, int(cu_before[-1]), 3 * 16 * 16)
    assert inputs["imgs_sizes"].tolist() == [list(s["clips"][0][0].size) for s in samples]

    with torch.no_grad():  # and the whole vision module (encoder + projection) lands in the LLM's width
        projected = model.modality_submodules[IMAGES](encoder_inputs={"radio": inputs})
    assert projected.shape == (sum(placeholders), settings.hidden_size)


def test_fixed_tiles_give_the_tile_token_count(world):
    settings, model = build(dynamic_resolution=False, image_size=64)
    task = SyntheticTask(settings)
    batch = task.collate([task.sample(seed=0, index=i) for i in range(3)])
    x = batch["modality_inputs"][IMAGES]["radio"]["x"]
    assert x.shape == (3, 3, 64, 64)
    with torch.no_grad():
        out = model.modality_submodules[IMAGES].encoders["radio"](x)
    assert out.shape[0] == (batch["input_ids"] == task.image_id).sum() == 3 * (64 // 16) ** 2 // 4


def test_every_layout_reads_the_same_samples_and_images_vary():
    settings = NemotronVLMSettings(**{**TINY, "image_probability": 0.5})
    whole = next(synthetic_batches(settings, DataContext(micro_batch_size=4, num_microbatches=1, num_lanes=1, seed=7)))
    lanes = [next(synthetic_batches(settings, DataContext(micro_batch_size=2, num_microbatches=1, num_lanes=2,
                                                          seed=7, first_position=p))) for p in (0, 2)]
    assert torch.equal(whole["input_ids"], torch.cat([lane["input_ids"] for lane in lanes]))
    # Half the samples carry an image; text fills every row to seq_length; labels never ask for a placeholder.
    batches = list(zip(range(10), synthetic_batches(settings, DataContext(4, 1, 1, seed=1))))
    counts = [int((b["input_ids"] == settings.vocab_size - 1).sum()) for _, b in batches]
    assert 0 in counts and max(counts) > 0
    assert all(b["input_ids"].shape == (4, settings.seq_length) for _, b in batches)
    assert all(((b["labels"] == settings.vocab_size - 1) & (b["loss_mask"] > 0)).sum() == 0 for _, b in batches)


# ------------------------------------------------------------------------------------ te against local specs


def _canonical(spec, table: dict):
    """A spec tree with each module class replaced through `table`. Routed experts become one marker: TE's
    TEGroupedMLP and megatron's SequentialMLP hold the same weights and checkpoint keys in different layouts."""
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

    def walk(x):
        if isinstance(x, functools.partial) and x.func in (SequentialMLP, TEGroupedMLP):
            return "routed-experts"
        if isinstance(x, ModuleSpec):
            return ("spec", walk(x.module), walk(x.params), walk(x.submodules))
        if isinstance(x, functools.partial):
            return ("partial", walk(x.func), walk(x.args), walk(x.keywords))
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return (type(x).__name__, {f.name: walk(getattr(x, f.name)) for f in dataclasses.fields(x)})
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        try:  # without transformer-engine installed, megatron-core's TE classes are MagicMock objects
            return table.get(x, x)
        except TypeError:  # unhashable leaf
            return x

    return walk(spec)


def test_local_specs_are_megatrons_te_specs_with_local_modules():
    """The te backend's specs are megatron-core's own; replacing each TE class by its entry in TE_TO_LOCAL gives
    exactly the local backend's specs: same layer kinds, submodules, parameters and order."""
    from mimo.providers.nemotron import specs

    for te_spec, local_spec in (
        (specs.hybrid_stack_spec("te", 4, 8), specs.hybrid_stack_spec("local", 4, 8)),
        (specs.vit_layer_spec("te"), specs.vit_layer_spec("local")),
        (specs.projection_submodules("te"), specs.projection_submodules("local")),
    ):
        assert _canonical(te_spec, specs.TE_TO_LOCAL) == _canonical(local_spec, {})
    # megatron-core's TE hybrid spec itself is left as it was (the conv width is set on a copy)
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    assert "d_conv" not in (hybrid_stack_spec.submodules.mamba_layer.submodules.mixer.params or {})
    assert specs.hybrid_stack_spec("te", 3, 8).submodules.mamba_layer.submodules.mixer.params["d_conv"] == 3


def test_image_token_comes_from_the_setting_or_the_tokenizer(tmp_path):
    from mimo.providers.nemotron.tokens import image_token_id

    settings = NemotronVLMSettings(**{**TINY, "image_token_id": 7})
    batch = next(synthetic_batches(settings, DataContext(micro_batch_size=4, num_microbatches=1, num_lanes=1,
                                                         seed=0)))
    placeholders = (batch["input_ids"] == 7).sum(1)
    assert (placeholders > 0).all()  # every sample has an image: its placeholders are 7, no caption token is
    assert all(row[n:].ne(7).all() for row, n in zip(batch["input_ids"], placeholders.tolist()))
    assert image_token_id(NemotronVLMSettings(**TINY)) == 263
    with pytest.raises(UsageError, match="has no tokenizer.json"):  # a folder that holds no tokenizer
        image_token_id(NemotronVLMSettings(**{**TINY, "tokenizer_path": str(tmp_path)}))


def test_radio_boundaries_left_on_the_host_reach_the_hidden_states_device():
    """RadioEncoder hands RADIO its THD boundaries on the host (its class-token shift writes one element, a
    blocking copy on a GPU tensor); the decoder's pre-hook moves them to the hidden states' device ('meta' here
    stands for the GPU) and leaves boundaries already there alone."""
    from mimo.providers.nemotron.model import _boundaries_to_device

    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), max_seqlen_q=18,
                             max_seqlen_kv=18)
    hidden = torch.empty(30, 1, 4, device="meta")
    _, kwargs = _boundaries_to_device(None, (hidden,), {"packed_seq_params": params})
    moved = kwargs["packed_seq_params"]
    assert moved.cu_seqlens_q.device.type == moved.cu_seqlens_kv.device.type == "meta"
    assert moved.max_seqlen_q == 18 and params.cu_seqlens_q.device.type == "cpu"  # the caller's object unchanged
    assert _boundaries_to_device(None, (torch.empty(30, 1, 4),), {"packed_seq_params": params}) is None


def test_balanced_routing_for_benchmarks_reaches_megatron_and_keeps_the_routers_out_of_graphs(world):
    """moe_router_force_load_balancing (benchmarks only): megatron-core's random routing logits, which no CUDA graph
    of the router may capture."""
    from mimo.providers.nemotron.model import _routers_graphable

    parallelism = layout.plan(LayoutOptions(), 1, nemotron.model_shape(NemotronVLMSettings(**TINY)),
                                micro_batch_size=1)
    topo = topology.build(parallelism, backend="gloo")
    ctx = BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)
    for balanced in (False, True):
        settings = NemotronVLMSettings(**{**TINY, "moe_router_force_load_balancing": balanced})
        spec = nemotron.build_language_model(settings, ctx)
        assert spec.params["config"].moe_router_force_load_balancing is balanced
        assert _routers_graphable(settings, ctx, "te") is not balanced
