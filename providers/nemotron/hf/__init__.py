"""Hugging Face checkpoints of the Nemotron VLM family <-> megatron-core state dicts.

Each tensor map converts one reference model of transformers (checked against it in tests/test_hf_*.py):
`radio` (the C-RADIO vision encoder <-> megatron-core's RADIOViTModel), `nemotron_h` (the hybrid Mamba / MoE /
attention LLM <-> megatron-core's HybridModel), `nemotron_h_omni` (the omni model's image path: its RADIO and the
projector into the LLM). `vlm` puts them together for the provider's hooks (`hf_settings`, `hf_to_mimo`,
`mimo_to_hf`); mimo's driver (core/checkpoint/hf.py) builds, loads and saves, and `mimo.plugins.kit.safetensors_io`
reads and writes the model folders.
"""
