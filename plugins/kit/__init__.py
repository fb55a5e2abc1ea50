"""What providers may reuse (public API): an SDPA core-attention module, per-layer memory formulas, loading
megatron-core dist checkpoints with every supported torch, and Hugging Face safetensors folders."""
