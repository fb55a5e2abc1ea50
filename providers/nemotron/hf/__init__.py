"""Hugging Face checkpoints of the Nemotron VLM family <-> the provider's model, declared as tensor maps
(`mimo.plugins.kit.tensor_map`) over the model's dist-checkpoint keys.

Each map covers one reference model of transformers (checked against it in tests/unit/test_hf_*.py): `radio` (the
C-RADIO vision encoder <-> megatron-core's RADIOViTModel), `nemotron_h` (the hybrid Mamba / MoE / attention LLM <->
megatron-core's HybridModel), `nemotron_h_omni` (the omni model's image path: its RADIO and the projector into the
LLM). `vlm` puts them together for the provider's hooks (`hf_settings`, `hf_tensor_map`, `hf_export_check`,
`hf_export`), `processor` writes the tokenizer and processor files of an export; mimo's drivers
(core/checkpoint/hf*.py) read each rank's slices and stream exports.
"""
