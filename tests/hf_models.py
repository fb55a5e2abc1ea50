"""Tiny random transformers models of the Nemotron omni VLM for tests, shaped like nemotron-moe-vlm-tiny, saved with
`save_pretrained`."""

from __future__ import annotations

import torch

# nemotron-moe-vlm-tiny's LLM (M * E M E) and RADIO (2 layers of 32, 1 class token + 1 register = its 2)
TEXT = dict(model_type="nemotron_h", vocab_size=264, hidden_size=64,
            layers_block_type=["mamba", "attention", "moe", "mamba", "moe"], num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
            conv_kernel=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=64, intermediate_size=64)
RADIO = dict(model_type="radio", hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2.0,
             patch_size=16, max_img_size=256, num_cls_tokens=1, num_registers=1, video_temporal_patch_size=2)


def save_omni(folder, text: dict = TEXT):
    """A random `NemotronH_Omni_Reasoning_V3` with the LLM config `text`, saved into `folder`."""
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    config = NemotronH_Omni_Reasoning_V3_Config(vision_config=RADIO, text_config=text, vision_hidden_size=32,
                                               projector_hidden_size=64, image_token_id=263)
    torch.manual_seed(0)
    model = NemotronH_Omni_Reasoning_V3(config).eval()
    with torch.no_grad():  # away from the initial values (norms of ones, zero biases), so that mixing them up shows
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and "lambda1" not in name:
                tensor.add_(torch.randn_like(tensor) * 0.02)
    model.save_pretrained(folder)
    return folder


# The same LLM without MoE layers (M * - M -): megatron-core needs sequence parallelism for MoE under TP, which
# the CPU lacks, so tensor-parallel tests use this one.
DENSE_TEXT = {**TEXT, "layers_block_type": ["mamba", "attention", "mlp", "mamba", "mlp"]}
# A released C-RADIO's shape scaled down: no video patch embedder, 1 class token and 1 register.
PART_RADIO = {k: v for k, v in RADIO.items() if k != "video_temporal_patch_size"}


def _away_from_init(model) -> None:
    """Every weight moved off its initial value (LayerScale and the input conditioner are no weights)."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and "lambda1" not in name and "input_conditioner" not in name:
                tensor.add_(torch.randn_like(tensor) * 0.02)


def save_llm(folder, text: dict = TEXT):
    """A random `NemotronHForCausalLM` with config `text`, saved sharded (several files and the index)."""
    import transformers

    config = transformers.NemotronHConfig(**{k: v for k, v in text.items() if k != "model_type"}, dtype="float32")
    torch.manual_seed(1)
    model = transformers.NemotronHForCausalLM(config).eval()
    _away_from_init(model)
    model.save_pretrained(folder, max_shard_size="100KB")
    return folder


def save_radio(folder, radio: dict = PART_RADIO):
    """A random `RadioModel` (C-RADIO's layout: no video embedder), saved into `folder`."""
    from transformers import RadioConfig, RadioModel

    torch.manual_seed(2)
    model = RadioModel(RadioConfig(**{k: v for k, v in radio.items() if k != "model_type"})).eval()
    _away_from_init(model)
    model.save_pretrained(folder)
    return folder
