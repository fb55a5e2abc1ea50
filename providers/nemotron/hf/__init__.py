"""Hugging Face checkpoints of the Nemotron VLM family <-> megatron-core state dicts.

Each module converts one reference model of transformers (checked against it in tests/test_hf_*.py):
`radio` (the C-RADIO vision encoder <-> megatron-core's RADIOViTModel), `nemotron_h` (the hybrid Mamba / MoE /
attention LLM <-> megatron-core's HybridModel), `nemotron_h_omni` (the omni model's image path: its RADIO and the
projector into the LLM). `safetensors_io` reads and writes Hugging Face model folders.
"""
