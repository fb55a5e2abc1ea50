"""Low-rank adapters (LoRA), a loop capability that knows no model: `lora.py` (one adapter and its sharding),
`linears.py` (megatron-core's linears with an adapter), `experts.py` (a MoE layer's routed experts),
`grouped_experts.py` (their adapter terms in mimo's grouped-GEMM experts), `targets.py`
(which layers --lora-targets names), `apply.py` (adding adapters to a model, merging them into it)."""
