"""Incremental decoding (core/generation/): with megatron-core's inference context (KV cache, Mamba state) the
greedy tokens equal a recomputation of the whole sequence at every step, for mock-vlm (both attention modules) and
the Nemotron VLM (Mamba, MoE, attention, RADIO); the pieces around it: SDPA on cached keys, the sampler, the chat
template's generation prompt and stop ids, and the answer scores."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from helpers import forked_call

from mimo.core.generation.sampling import Sampler, SamplingOptions
from mimo.core.generation.text_metrics import exact_match, normalize, token_f1
from mimo.data import NEMOTRON, PLAIN, ByteTokenizer
from mimo.data.conversation import IMAGE, Turn


def _decode_into(out: str, provider: str, assignments: tuple[str, ...]) -> None:
    import decode_worker

    with open(out, "w") as stdout, contextlib.redirect_stdout(stdout):
        decode_worker.main(provider, list(assignments))


def decode(tmp_path, provider: str, *assignments: str) -> list[dict]:
    """tests/decode_worker.py's lines, run in a process of its own (a world of one)."""
    out = tmp_path / "decoded.jsonl"
    forked_call(_decode_into, (str(out), provider, assignments))
    return [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]


@pytest.mark.parametrize("provider, assignments", [
    ("mock-vlm", ("seq_length=256",)),
    ("mock-vlm", ("seq_length=256", "attention=local")),  # megatron-core's own DotProductAttention
    # M * E M E: Mamba (its state over two scan chunks for the long prompt), attention, MoE; RADIO's dynamic
    # resolution
    ("nemotron-moe-vlm-tiny", ("backend=local", "seq_length=256")),
])
def test_cached_decoding_gives_the_tokens_of_recomputing_everything(provider, assignments, tmp_path):
    results = decode(tmp_path, provider, *assignments)
    assert [r["prompt"] for r in results] == ["image", "text", "long"]
    for r in results:
        assert r["cached"] == r["recomputed"] and len(r["cached"]) == 24, r
        # the sync-free decoder (one-token MoE path, stop checks every few steps) equals megatron-core's path
        assert r["plain"] == r["cached"], r
        assert r["stopped"] == r["plain_stopped"], r
        assert r["stopped"]["stop"] == "end" and len(r["stopped"]["tokens"]) <= 10, r
        # attention with the position on the device (what a CUDA graph replays), from a cache kept between calls
        assert r["device"] == r["cached"] and r["device_stopped"] == r["plain_stopped"], r
        assert r["steps"] == "device" and r["default_steps"] == "sync-free" and r["one_token_attention_layers"] > 0
    # the cache is kept while answers fit and replaced by a longer one when not
    caches = [r["cache_positions"] for r in results]
    assert caches[0] == caches[1] < caches[2], results
    assert all(c % 64 == 0 and c - 64 < r["prompt_tokens"] + 24 <= c for c, r in zip(caches[::2], results[::2]))
    assert max(r["prompt_tokens"] for r in results) > 128  # the long prompt (two images) spans two Mamba chunks
    assert len({tuple(r["cached"]) for r in results}) > 1  # the answers depend on the prompt
    assert results[0]["sync_free_moe_layers"] == (2 if provider.startswith("nemotron") else 0)  # M*EME


def test_sdpa_aligns_the_causal_mask_to_the_last_key():
    """A query after cached keys (sq < sk) sees every key up to its own position, not torch's top-left mask."""
    from megatron.core.transformer.enums import AttnMaskType
    from mimo.plugins.kit.attention import SDPAttention

    q, k, v = (torch.randn(6, 1, 2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    attention = SDPAttention.__new__(SDPAttention)
    torch.nn.Module.__init__(attention)
    attention.softmax_scale, attention.dropout, attention.heads, attention.groups = 0.5, 0.0, 2, 2
    attention.attn_mask_type, attention.cp_group = AttnMaskType.causal, None
    whole = attention(q, k, v, None)
    last_two = attention(q[4:], k, v, None)  # the last two queries against all six keys
    torch.testing.assert_close(last_two, whole[4:])


def test_greedy_picks_the_largest_and_sampling_repeats_with_its_seed():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0, 0.5])
    assert int(Sampler(SamplingOptions(), torch.device("cpu")).choose(logits)) == 1
    state = torch.random.get_rng_state()

    def draws(options, index=0):
        sampler = Sampler(options, torch.device("cpu"))
        sampler.start(index)
        return [int(sampler.choose(logits)) for _ in range(40)]

    hot = SamplingOptions(temperature=2.0, seed=7)
    assert draws(hot) == draws(hot) and draws(hot) != draws(hot, index=1)
    assert len(set(draws(hot))) > 2
    assert set(draws(SamplingOptions(temperature=2.0, top_k=2))) <= {1, 2}
    assert set(draws(SamplingOptions(temperature=2.0, top_p=0.3))) == {1}  # the nucleus holds the top token only
    assert torch.equal(torch.random.get_rng_state(), state)  # never the global generator


@pytest.mark.parametrize("bad, message", [(dict(temperature=-1), "--temperature"), (dict(top_p=0), "--top-p"),
                                          (dict(top_k=-2), "--top-k")])
def test_bad_sampling_options_are_one_line(bad, message):
    from mimo.errors import UsageError

    with pytest.raises(UsageError, match=message):
        SamplingOptions(**bad).validate()


def test_the_generation_prompt_ends_with_the_assistant_header_and_answers_stop_at_the_end_of_turn():
    tok = ByteTokenizer(special_tokens=NEMOTRON.special_tokens)
    turns = [Turn("user", (IMAGE, "Colour?"))]
    ids = NEMOTRON.generation_prompt(turns, [2], tok)
    assert tok.decode(ids, skip_special_tokens=False).endswith("Colour?<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(tok.image_token_id) == 2
    assert NEMOTRON.stop_ids(tok) == {tok.encode("<|im_end|>")[0], tok.eos_id}
    plain = ByteTokenizer()
    assert PLAIN.generation_prompt(turns, [1], plain)[-1] == plain.encode("\n")[0] and PLAIN.stop_ids(plain) == {
        plain.eos_id}


def test_answers_are_scored_as_squad_scores_them():
    assert normalize("The  Red, disc!") == "red disc"
    assert exact_match("a red disc.", "Red disc") == 1.0 and exact_match("red", "red disc") == 0.0
    assert token_f1("red disc", "the red round disc") == pytest.approx(2 * 1.0 * (2 / 3) / (1 + 2 / 3))
    assert token_f1("blue", "red") == 0.0 and token_f1("", "") == 1.0 and token_f1("", "red") == 0.0


def test_an_unknown_way_of_stepping_is_one_line():
    from mimo.core.generation.decoder import Decoder
    from mimo.errors import UsageError

    with pytest.raises(UsageError, match=r"^decoding steps 'fast': choose one of auto, graph, device, sync-free, "
                                         r"waiting$"):
        Decoder(None, device=torch.device("cpu"), params_dtype=torch.float32, steps="fast")
