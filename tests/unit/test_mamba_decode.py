"""LocalMambaMixer decoding (providers/nemotron/mamba_decode.py): the scan's final state is the recurrence's, a
prompt then one token at a time gives the whole sequence's output, the state sits in megatron-core's layout (its
own MambaMixer decode step continues it the same), and a context outside InferenceMode changes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers import world_of_one
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.utils import InferenceMode
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from mimo.core.run.launch import seed_everything
from mimo.providers.nemotron.mamba_mixer import LocalMambaMixer, MambaMixerSubmodules, ssd_scan
from test_mamba_mixer import _scan_inputs, reference_ssm_scan


def reference_final_state(x, dt, A, B, C):
    b, l, h, p = x.shape
    r = h // B.shape[2]
    B = B.repeat_interleave(r, dim=2)
    state = x.new_zeros(b, h, p, B.shape[-1])
    for t in range(l):
        dt_t = dt[:, t, :, None, None]
        state = torch.exp(dt_t * A[:, None, None]) * state + dt_t * x[:, t, :, :, None] * B[:, t, :, None, :]
    return state


@pytest.mark.parametrize("l", [1, 3, 8, 21])
def test_the_scan_returns_the_recurrence_final_state(l):
    inputs = [t.detach() for t in _scan_inputs(l, D_per_channel=l == 3)]
    y, final = ssd_scan(*inputs, chunk_size=8, return_final_state=True)
    torch.testing.assert_close(y, reference_ssm_scan(*inputs), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, reference_final_state(*inputs[:5]), rtol=1e-10, atol=1e-10)


@pytest.fixture(scope="module")
def mixer():
    with world_of_one():
        group = dist.new_group([0])
        pgs = ProcessGroupCollection(tp=group, cp=group, pp=group, dp=group, dp_cp=group, tp_cp=group, ep=group,
                                     expt_tp=group, expt_dp=group, tp_ep=group, mp=group)
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, mamba_num_heads=4,
                                   mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=6,
                                   use_cpu_initialization=True)
        seed_everything(3, tp_rank=0, ep_rank=0, etp_rank=0)
        spec = MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)
        # a step-size clamp that binds for some steps: decoding must clamp as the scan does
        yield LocalMambaMixer(config, spec, d_model=16, chunk_size=4, layer_number=1, dt_limit=(0.05, 5.0),
                              pg_collection=pgs).eval()


@pytest.mark.parametrize("prompt", [2, 9])  # shorter than the convolution's window, and over two scan chunks
def test_prompt_then_one_token_at_a_time_equals_the_whole_sequence(mixer, prompt):
    hidden = torch.randn(prompt + 6, 1, 16, generator=torch.Generator().manual_seed(prompt))
    with torch.no_grad():
        whole, _ = mixer(hidden)
        context = StaticInferenceContext(1, 32)
        with InferenceMode.active():
            outs = [mixer(hidden[:prompt], inference_context=context)[0]]
            context.increment_sequence_len_offset(prompt)
            for t in range(prompt, hidden.shape[0]):
                outs.append(mixer(hidden[t:t + 1], inference_context=context)[0])
                context.increment_sequence_len_offset(1)
    torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-5, atol=1e-6)
    conv, ssm = context.key_value_memory_dict[1]  # MambaMixer's shapes: [b, conv channels, d_conv], [b, h, p, n]
    assert tuple(conv.shape) == (1, 32 + 2 * 2 * 6, 4) and tuple(ssm.shape) == (1, 4, 8, 6)


def test_megatron_cores_decode_step_continues_the_same_state(mixer, monkeypatch):
    from megatron.core.ssm import mamba_mixer as mcore

    monkeypatch.setattr(mcore, "causal_conv1d_update", None)  # its pure-torch paths, which need no GPU
    monkeypatch.setattr(mcore, "selective_state_update", None)
    monkeypatch.setattr(mixer, "act", torch.nn.SiLU(), raising=False)
    monkeypatch.setattr(mixer, "dt_limit", (0.0, float("inf")))  # MambaMixer's decode does not clamp
    hidden = torch.randn(7, 1, 16, generator=torch.Generator().manual_seed(0))
    token = torch.randn(1, 1, 16, generator=torch.Generator().manual_seed(1))
    context = StaticInferenceContext(1, 16)
    with torch.no_grad(), InferenceMode.active():
        mixer(hidden, inference_context=context)
        context.increment_sequence_len_offset(7)
        conv, ssm = (t.clone() for t in context.key_value_memory_dict[1])
        ours, _ = mixer(token, inference_context=context)
        zxBCdt, _ = mixer.in_proj(token)
        theirs, _ = mixer.out_proj(mcore.MambaMixer._ssm_decode(mixer, zxBCdt.transpose(0, 1), conv, ssm)
                                   .transpose(0, 1))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(context.key_value_memory_dict[1][1], ssm, rtol=1e-5, atol=1e-6)


def test_a_context_outside_inference_mode_changes_nothing(mixer):
    hidden = torch.randn(5, 1, 16)
    context = StaticInferenceContext(1, 8)
    context.sequence_len_offset = 3  # would decode, were InferenceMode on
    with torch.no_grad():
        assert torch.equal(mixer(hidden, inference_context=context)[0], mixer(hidden)[0])
    assert context.key_value_memory_dict == {}
