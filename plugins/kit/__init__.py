"""What providers may reuse (public API): an SDPA core-attention module, per-layer memory formulas, loading
megatron-core dist checkpoints with every supported torch, Hugging Face safetensors folders read slice by slice and
written shard by shard, and tensor maps declaring where a model's tensors are in them."""
