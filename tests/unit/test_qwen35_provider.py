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
