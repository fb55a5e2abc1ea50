"""Hugging Face checkpoints of the Qwen3.5 family <-> the provider's model, declared as tensor maps
(`mimo.plugins.kit.tensor_map`) over the model's dist-checkpoint keys: `qwen3_5` the language model (checked
against transformers in tests/unit/test_hf_qwen35.py), `vlm` the whole `Qwen3_5ForConditionalGeneration` /
`Qwen3_5MoeForConditionalGeneration` folder for the provider's hooks, and the export of the language model as a
`Qwen3_5ForCausalLM` folder."""
