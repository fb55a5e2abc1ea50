"""The qwen3.5-vl providers (providers/qwen35/): registered through the `mimo.providers` entry point and built on the
public plugin API alone; the local gated delta net's chunked rule against the recurrence it computes; packed (THD)
rows computing each sample as if alone; settings refused in one line."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest
import torch

from helpers import REPO, world_of_one
from mimo.plugins.settings import build_settings
from test_hf_chat_template import CHATML, backend, folder_with  # noqa: F401 (backend: a byte-level BPE fixture)


def test_the_package_is_a_provider_entry_point_like_any_third_party():
    entry_points = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["mimo.providers"]
    assert entry_points["qwen35"] == "mimo.providers.qwen35"
    from mimo.providers import qwen35

    names = [p.name for p in qwen35.register_providers()]
    assert {"qwen3.5-vl-tiny", "qwen3.5-vl-moe-tiny", "qwen3.5-vl-27b", "qwen3.5-vl-35b-a3b"} <= set(names)


def test_the_package_imports_no_mimo_core():
    """Every module of the package imported (megatron-core included): mimo.core never loads."""
    code = ("import importlib, pkgutil, sys\n"
            "import mimo.providers.qwen35 as package\n"
            "for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
            "    importlib.import_module(info.name)\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('mimo.providers.qwen35'))\n"
            "assert 'mimo.providers.qwen35.model' in loaded and 'mimo.providers.qwen35.hf.vlm' in loaded, loaded\n"
            "print(sorted(m for m in sys.modules if m == 'mimo.core' or m.startswith('mimo.core.')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def _recurrence(q, k, v, g, beta):
    """The gated delta rule step by step: S = e^g S + beta k (v - S^T k)^T, o = S^T q / sqrt(dk)."""
    b, s, h, dk = k.shape
    state = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(s):
        kt, vt, qt = k[:, t].double(), v[:, t].double(), q[:, t].double() * dk ** -0.5
        state = state * g[:, t].double().exp()[..., None, None]
        delta = beta[:, t].double()[..., None] * (vt - torch.einsum("bhkv,bhk->bhv", state, kt))
        state = state + torch.einsum("bhk,bhv->bhkv", kt, delta)
        out.append(torch.einsum("bhkv,bhk->bhv", state, qt))
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("length", [5, 64, 150])
def test_the_chunked_rule_computes_the_recurrence(length):
    from mimo.providers.qwen35.delta_rule import chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(length)
    q, k = (torch.nn.functional.normalize(torch.randn(2, length, 3, 8, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(2, length, 3, 6, generator=gen)
    g, beta = -torch.rand(2, length, 3, generator=gen) * 3, torch.rand(2, length, 3, generator=gen)
    got = chunk_gated_delta_rule(q, k, v, g, beta, chunk=16)
    assert got.shape == v.shape and torch.allclose(got.double(), _recurrence(q, k, v, g, beta), atol=1e-5)


def _tiny_model(**overrides):
    from megatron.core.transformer.spec_utils import build_module

    from mimo.core.config import LayoutOptions
    from mimo.core.parallel import layout, topology
    from mimo.core.run.launch import seed_everything
    from mimo.plugins import BuildContext
    from mimo.providers import qwen35

    settings = qwen35.Qwen35Settings(**{**qwen35.TINY, "backend": "local", **overrides})
    parallelism = layout.plan(LayoutOptions(), 1, qwen35.model_shape(settings), micro_batch_size=1)
    topo = topology.build(parallelism, backend="gloo")
    seed_everything(0, tp_rank=0, ep_rank=0, etp_rank=0)
    ctx = BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)
    return build_module(qwen35.build_language_model(settings, ctx)).eval()


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded places"])
def test_a_packed_row_computes_each_sample_as_if_alone(padded):
    """Two samples in one THD row (positions restarting): the gated delta net starts each with an empty state and
    convolution window, attention stays within each, so the logits are each sample's own."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths, places = [11, 17], ([16, 24] if padded else [11, 17])
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 264, (1, n), generator=gen) for n in places]
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    cu_places = torch.tensor([0, places[0], sum(places)], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(),
                             cu_seqlens_q_padded=cu_places if padded else None,
                             cu_seqlens_kv_padded=cu_places.clone() if padded else None,
                             max_seqlen_q=max(places), max_seqlen_kv=max(places))
    with world_of_one(), torch.no_grad():
        model = _tiny_model()
        row = torch.cat(samples, dim=1)
        positions = torch.cat([torch.arange(n) for n in places])[None]
        got = model(row, position_ids=positions, attention_mask=None, packed_seq_params=packed)
        start = 0
        for sample, n, place in zip(samples, lengths, places):
            alone = model(sample[:, :n], position_ids=torch.arange(n)[None], attention_mask=None)
            assert torch.allclose(got[:, start:start + n], alone, atol=1e-5), (n, place)
            start += place


@pytest.mark.parametrize("setting, message", [
    ("mrope_section=[4,1,1]", "mrope_section [4, 1, 1] must be 3 sizes (temporal, height, width) summing to "
                              "kv_channels x rotary_percent / 2 = 4"),
    ("layer_pattern=GG-G", "layer_pattern 'GG-G' must be made of G (gated delta net) and * (full attention); it has "
                           "['-']"),
    ("num_experts=2", "moe_router_topk 8 must be at most num_experts 2"),
])
def test_settings_that_cannot_be_built_are_one_line(setting, message):
    from mimo.errors import UsageError
    from mimo.providers import qwen35

    tiny = next(p for p in qwen35.VARIANTS if p.name == "qwen3.5-vl-tiny")
    with pytest.raises(UsageError) as err:
        build_settings(tiny, [setting])
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("prompt", [2, 9])  # shorter than the convolution's window, and longer
def test_decoding_with_an_inference_context_equals_the_whole_sequence(prompt):
    """The prompt, then one token at a time with megatron-core's static inference context: the gated delta net
    continues its convolution and rule state, attention its cache with the MRoPE frequencies so far; every call's
    logits equal those of the whole sequence at once."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.utils import InferenceMode

    tokens = torch.randint(0, 264, (1, prompt + 6), generator=torch.Generator().manual_seed(prompt))
    positions = torch.arange(tokens.shape[1])[None]
    with world_of_one(), torch.no_grad():
        model = _tiny_model()
        whole = model(tokens, position_ids=positions, attention_mask=None)
        context = StaticInferenceContext(1, 32)
        with InferenceMode.active():
            steps = [model(tokens[:, :prompt], position_ids=positions[:, :prompt], attention_mask=None,
                           inference_context=context, runtime_gather_output=True)[:, -1]]
            context.increment_sequence_len_offset(prompt)
            for t in range(prompt, tokens.shape[1]):
                steps.append(model(tokens[:, t:t + 1], position_ids=positions[:, t:t + 1], attention_mask=None,
                                   inference_context=context, runtime_gather_output=True)[:, -1])
                context.increment_sequence_len_offset(1)
    torch.testing.assert_close(torch.stack(steps, dim=1), whole[:, prompt - 1:], rtol=1e-5, atol=1e-5)


def test_generation_refuses_a_vocabulary_too_small_for_its_tokenizer_in_one_line():
    from mimo.errors import UsageError
    from mimo.providers import qwen35

    settings = qwen35.Qwen35Settings(**{**qwen35.TINY, "vocab_size": 200})
    with pytest.raises(UsageError, match="^UTF-8 bytes take 260 token ids, more than vocab_size 200: --set "):
        qwen35.prompt_format(settings)


def test_both_backends_build_the_same_layer_kinds():
    """te swaps each local piece for transformer-engine's (spec level: no GPU here); the rest is shared."""
    from mimo.providers.qwen35 import specs

    for experts in (0, 4):
        local, te = (specs.layer_specs("G*", backend, experts) for backend in ("local", "te"))
        for a, b in zip(local, te):
            assert a.module is b.module and type(a.submodules) is type(b.submodules)
            mixer_a, mixer_b = a.submodules.self_attention, b.submodules.self_attention
            assert issubclass(mixer_a.module, mixer_b.module)  # LocalGatedDeltaNet < Qwen35GatedDeltaNet
            if experts:
                assert a.submodules.pre_mlp_layernorm is not b.submodules.pre_mlp_layernorm


@pytest.mark.parametrize("kernels", ["te", "local"])
def test_expert_gemm_chooses_the_kits_grouped_experts_over_megatrons(kernels):
    """expert_gemm: grouped_mm (and auto on te) builds every MoE layer as the kit's DeviceCountsMoELayer with the
    grouped-GEMM subclass of megatron-core's experts class for that backend (spec level: no GPU here); megatron
    (and auto on local) leaves megatron-core's spec as it is."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mimo.plugins.kit.grouped_mm_moe import DeviceCountsMoELayer, GroupedMMExperts, GroupedMMSequentialMLP
    from mimo.providers.qwen35 import specs

    megatron = specs.layer_specs("G*", kernels, 4, "megatron")
    for expert_gemm in ("auto", "grouped_mm", "megatron"):
        grouped = expert_gemm == "grouped_mm" or (expert_gemm == "auto" and kernels == "te")
        assert specs.uses_grouped_mm(expert_gemm, kernels) is grouped
        for spec, plain in zip(specs.layer_specs("G*", kernels, 4, expert_gemm), megatron):
            assert spec.module is plain.module
            mlp, plain_mlp = spec.submodules.mlp, plain.submodules.mlp
            experts = mlp.keywords["submodules"].experts.func
            plain_experts = plain_mlp.keywords["submodules"].experts.func
            assert plain_mlp.func is MoELayer
            if grouped:
                assert mlp.func is DeviceCountsMoELayer and experts in (GroupedMMExperts, GroupedMMSequentialMLP)
                assert issubclass(experts, plain_experts)
            else:
                assert mlp.func is MoELayer and experts is plain_experts
    dense = specs.layer_specs("G*", kernels, 0, "grouped_mm")  # no experts: the dense MLP as it is
    assert all(spec.submodules.mlp.func is not DeviceCountsMoELayer for spec in dense)


def test_generation_prompts_in_a_qwen_folders_own_chat_template(tmp_path, backend):
    """chat_template=auto with a tokenizer folder that has Qwen's ChatML Jinja template: prompts render in it (the
    generation prompt opens the assistant's turn, which <|im_end|> ends); without a folder, the plain template."""
    from mimo.data.conversation import Turn
    from mimo.data.prompts import Prompt, encode
    from mimo.providers import qwen35

    folder = folder_with(tmp_path, backend, "qwen", CHATML)
    settings = qwen35.Qwen35Settings(**{**qwen35.TINY, "vocab_size": 400, "tokenizer_path": str(folder)})
    fmt = qwen35.prompt_format(settings)
    assert fmt.template.answer_end == "<|im_end|>"
    encoded = encode(Prompt([Turn("user", ("What colour is the circle?",))], []), fmt)
    text = fmt.tokenizer.decode(encoded.input_ids[0].tolist(), skip_special_tokens=False)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat colour is "
                    "the circle?<|im_end|>\n<|im_start|>assistant\n")
    assert qwen35.prompt_format(qwen35.Qwen35Settings(**qwen35.TINY)).template.name == "plain"


@pytest.mark.parametrize("provider, layout, message", [
    ("qwen3.5-vl-tiny", {"llm_cp": 2}, "provider 'qwen3.5-vl-tiny': --llm-cp 2 needs backend te (the gated delta "
                                       "net's context parallelism is flash-linear-attention's): --set backend=te, or "
                                       "--llm-cp 1"),
    ("qwen3.5-vl-moe-tiny", {"llm_tp": 2, "encoder_tp": 2},
     "--llm-tp 2 with a mixture-of-experts LLM needs --sequence-parallel (megatron-core's MoE layers under TP), or "
     "keep --llm-tp 1 and split the experts with --llm-ep"),
])
def test_layouts_the_local_backend_cannot_build_are_refused_in_one_line_before_any_process(provider, layout, message):
    """What the local backend cannot split (the gated delta net's sequence; MoE layers under TP, which need
    sequence parallelism) is refused by `mimo plan` and the launcher in one line, before any process starts."""
    from mimo.core.config import LaunchOptions, LayoutOptions, RunConfig, TrainingOptions
    from mimo.core.run.plan import prepare
    from mimo.errors import UsageError

    config = RunConfig(provider=provider, provider_settings=["backend=local"], launch=LaunchOptions(nproc_per_node=2),
                       layout=LayoutOptions(**layout), training=TrainingOptions(device="cpu"))
    with pytest.raises(UsageError) as err:
        prepare(config, world_size=2, planning=True)
    assert str(err.value) == message


# --------------------------------------------------------------------------------------------- --cuda-graphs


def _graph_context(settings, **options):
    """A BuildContext of one rank (or the LLM over `llm_tp` ranks) with --cuda-graphs and `options`."""
    from mimo.plugins import LANGUAGE, BuildContext, ModuleParallelism

    tp = options.pop("llm_tp", 1)
    return BuildContext(params_dtype=torch.bfloat16, parallelism={LANGUAGE: ModuleParallelism(0, tp, tp=tp)},
                        pg_collections={},
                        **{"cuda_graphs": True, **options})


@pytest.mark.parametrize("variant, settings, options, modules", [
    ("moe", {}, {}, ["attn", "moe_router"]),  # expert_gemm auto: grouped GEMMs on te
    ("moe", {"expert_gemm": "grouped_mm"}, {}, ["attn", "moe_router"]),
    ("moe", {"expert_gemm": "megatron"}, {}, ["attn"]),  # transformer-engine's experts wait for the host
    ("moe", {}, {"fp8": "tensorwise"}, ["attn"]),
    ("moe", {}, {"llm_tp": 2, "sequence_parallel": True}, ["attn"]),
    ("moe", {}, {"recompute": {"language": "selective"}}, ["attn"]),
    ("moe", {"num_experts": 1, "moe_router_topk": 1}, {}, ["attn"]),
    ("dense", {}, {}, ["attn"]),
])
def test_cuda_graphs_capture_the_mixers_and_where_nothing_waits_the_routers(variant, settings, options, modules):
    """--cuda-graphs on backend te: every layer's mixer (gated delta net or gated attention), and the MoE layers'
    routers (with the shared expert) where the routed experts are the kit's grouped GEMMs, LLM TP 1, no FP8, no LLM
    recomputation; nothing without --cuda-graphs."""
    from mimo.providers import qwen35
    from mimo.providers.qwen35.graphs import cuda_graph_fields

    s = qwen35.Qwen35Settings(**{**(qwen35.MOE_TINY if variant == "moe" else qwen35.TINY), **settings})
    assert cuda_graph_fields(s, _graph_context(s, **options), "te") == {"cuda_graph_modules": modules}
    assert cuda_graph_fields(s, _graph_context(s, cuda_graphs=False), "te") == {}


@pytest.mark.parametrize("backend, options, message", [
    ("local", {}, "--cuda-graphs needs backend te: --set backend=te (transformer-engine, fla, a GPU)"),
    ("te", {"llm_input_packed": True}, "--cuda-graphs: packed --data gives the LLM sequences of another length "
                                       "every micro-batch"),
    ("te", {"recompute": {"language": "full"}}, "--cuda-graphs with --recompute full for the language model: "
                                                "megatron-core captures its layers only without full recomputation"),
])
def test_cuda_graphs_the_run_cannot_capture_are_refused_in_one_line(backend, options, message):
    from mimo.providers import qwen35
    from mimo.providers.qwen35.graphs import cuda_graph_fields

    s = qwen35.Qwen35Settings(**qwen35.MOE_TINY)
    with pytest.raises(ValueError) as err:
        cuda_graph_fields(s, _graph_context(s, **options), backend)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_captured_attention_layer_takes_the_multimodal_rotary_frequencies_as_an_input():
    """transformer-engine's graph of a layer takes the static inputs megatron-core's layer names (only plain RoPE's
    frequencies besides the hidden states and mask) and drops every other argument at replay. Replayed that way
    (the layer's capture function run on its static inputs, the call's tensors copied into those it has), a full
    attention layer with 3-D image positions computes its eager output: its frequencies are a static input of the
    shape the eager forward saw. Without that input the attention would rotate by nothing."""
    from megatron.core.transformer.enums import CudaGraphModule
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mimo.providers.qwen35.layers import MRoPEAttentionLayer

    seq, batch = 16, 2
    tokens = torch.randint(0, 264, (batch, seq), generator=torch.Generator().manual_seed(0))
    grid = torch.arange(seq)
    positions = torch.stack([grid.expand(batch, seq), (grid // 4).expand(batch, seq), (grid % 4).expand(batch, seq)])
    calls = {}
    with world_of_one(), torch.no_grad():
        model = _tiny_model()
        layers = list(model.decoder.layers)
        assert [type(layer) for layer in layers] == [TransformerLayer, TransformerLayer, MRoPEAttentionLayer,
                                                     TransformerLayer]  # GG*G
        attention = layers[2]
        with pytest.raises(RuntimeError, match="capture before an eager forward gave its rotary frequencies' shape"):
            attention.get_layer_static_inputs(seq, batch)
        attention.register_forward_hook(lambda m, args, kwargs, out: calls.update(kwargs=kwargs, out=out),
                                        with_kwargs=True)
        model(tokens, position_ids=positions, attention_mask=None)
        call = dict(calls["kwargs"])
        hidden, rotary = call.pop("hidden_states"), call["rotary_pos_emb"]
        assert attention.rotary_layout == (rotary.shape, torch.float32) and rotary.shape[:2] == (seq, batch)

        def replay(static):
            inputs = {k: call[k] if call.get(k) is not None else v for k, v in static.items() if k != "hidden_states"}
            inputs["attention_mask"] = torch.zeros_like(static["attention_mask"])  # megatron-core's replay mask
            return attention._te_cuda_graph_capture(hidden, **inputs)[0]

        static = attention.get_layer_static_inputs(seq, batch)
        assert static["rotary_pos_emb"].shape == rotary.shape and not static["rotary_pos_emb"].any()
        torch.testing.assert_close(replay(static), calls["out"][0], rtol=0, atol=0)
        plain = TransformerLayer.get_layer_static_inputs(attention, seq, batch)  # megatron-core's own
        assert "rotary_pos_emb" not in plain
        assert (replay(plain) - calls["out"][0]).abs().max() > 1e-4
        modules = attention.config.cuda_graph_modules
        attention.config.cuda_graph_modules = [CudaGraphModule.moe_router]  # attention left eager: no input
        try:
            assert "rotary_pos_emb" not in attention.get_layer_static_inputs(seq, batch)
        finally:
            attention.config.cuda_graph_modules = modules
