"""Hugging Face Qwen3.5 language models (`qwen3_5_text` dense, `qwen3_5_moe_text`: the `text_config` of
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`) <-> the provider's language model.

Names are a checkpoint's, as `save_pretrained` writes them, relative to the text model (`layers.N.linear_attn...`,
`embed_tokens.weight`, `norm.weight`; the caller puts `model.language_model.` before them) and `lm_head.weight`.
Keys are the language model's dist-checkpoint keys (the same for the `local` and `te` backends). Values are
unchanged: Qwen's zero-centered norms store `w` as megatron-core's do with `layernorm_zero_centered_gamma`.

Layouts that change (rows only):
* full attention: transformers' `q_proj` holds, per query head, its query rows then its output gate's; megatron's
  `linear_qkv` holds, per key/value group, the group's query heads, their gates, then the group's key and value.
* gated delta net: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` are the parts `query`, `key`, `value`, `z`,
  `beta`, `alpha` of megatron's one `in_proj` (saved as such parts); `conv1d.weight` the parts `query`, `key`,
  `value`.
* SwiGLU: `gate_proj` and `up_proj` are one `linear_fc1` (gate rows first); routed experts stack as
  `mlp.experts.experts.linear_fc1.weight` [E, 2 ffn, h].
"""

from __future__ import annotations

from collections.abc import Mapping

from mimo.errors import UsageError
from mimo.plugins.kit.tensor_map import Cat, Src, Stack, TensorMap, prefixed

from ..settings import HF_LAYER_TYPES

TEXT_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
IGNORED_PREFIXES = ("mtp.",)  # the multi-token-prediction head, which transformers does not load either
# Config fields with the one value the provider implements: field -> (value, meaning).
FIXED_FIELDS = {
    "hidden_act": ("silu", "the MLPs, experts and gated delta net convolution use SiLU"),
    "attention_bias": (False, "the attention projections have no bias"),
}


def config_fields(text: Mapping) -> dict:
    """Qwen35Settings fields of a Qwen3.5 text config (a dict). A value the provider cannot express raises
    UsageError, one line naming the field."""
    for field, (value, meaning) in FIXED_FIELDS.items():
        if text.get(field, value) != value:
            raise UsageError(f"Hugging Face config {field}={text[field]!r} is not supported: {meaning} "
                             f"({field}={value!r})")
    types = text.get("layer_types")
    if types is None:
        interval = text.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(text["num_hidden_layers"])]
    unknown = sorted(set(types) - set(HF_LAYER_TYPES))
    if unknown:
        raise UsageError(f"Hugging Face config layer_types has {unknown}: the provider builds linear_attention and "
                         f"full_attention layers")
    rope = text.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise UsageError(f"Hugging Face config rope_parameters.rope_type={rope['rope_type']!r} is not supported: "
                         f"the provider applies plain (default) RoPE")
    heads = text["num_attention_heads"]
    fields = dict(
        layer_pattern="".join(HF_LAYER_TYPES[t] for t in types), hidden_size=text["hidden_size"],
        num_attention_heads=heads, num_query_groups=text.get("num_key_value_heads") or heads,
        kv_channels=text.get("head_dim") or text["hidden_size"] // heads,
        rotary_percent=float(rope.get("partial_rotary_factor", 0.25)), rotary_base=float(rope.get("rope_theta",
                                                                                                   10000.0)),
        mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
        linear_num_key_heads=text["linear_num_key_heads"], linear_num_value_heads=text["linear_num_value_heads"],
        linear_key_head_dim=text["linear_key_head_dim"], linear_value_head_dim=text["linear_value_head_dim"],
        linear_conv_kernel=text.get("linear_conv_kernel_dim", 4), norm_epsilon=float(text.get("rms_norm_eps", 1e-6)),
        vocab_size=text["vocab_size"], dropout=float(text.get("attention_dropout", 0.0)),
        init_method_std=float(text.get("initializer_range", 0.02)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
    )
    if text.get("model_type") == "qwen3_5_moe_text":
        fields.update(num_experts=text["num_experts"], moe_router_topk=text["num_experts_per_tok"],
                      moe_ffn_hidden_size=text["moe_intermediate_size"],
                      moe_shared_expert_intermediate_size=text["shared_expert_intermediate_size"],
                      moe_aux_loss_coeff=float(text.get("router_aux_loss_coef", 0.001)))
    else:
        fields.update(num_experts=0, ffn_hidden_size=text["intermediate_size"])
    return fields


# ------------------------------------------------------------------------------------------------- tensor map


def tensor_map(f: Mapping, text_prefix: str) -> TensorMap:
    """Where each dist-checkpoint key of the language model (relative to it) is, for settings `f` (a mapping of
    Qwen35Settings fields): the text model's tensors under `text_prefix` (`model.language_model.` in a VLM folder,
    `model.` in a Qwen3_5ForCausalLM one), the output layer at `lm_head.weight` unless it is tied to the
    embedding (then the folder's copy, if any, is not read)."""
    t = {"embedding.word_embeddings.weight": Src(f"{text_prefix}embed_tokens.weight"),
         "decoder.final_layernorm.weight": Src(f"{text_prefix}norm.weight")}
    tied = f["tie_word_embeddings"]
    if not tied:
        t["output_layer.weight"] = Src("lm_head.weight")
    for i, symbol in enumerate(f["layer_pattern"]):
        layer = {**_mixer(symbol, f), **_mlp(f)}
        t.update({f"decoder.layers.{i}.{key}": prefixed(spec, f"{text_prefix}layers.{i}.")
                  for key, spec in layer.items()})
    return TensorMap(t, covers=("",), ignored=IGNORED_PREFIXES + (("lm_head.",) if tied else ()))



def _rows(name: str, start: int, size: int) -> Src:
    return Src(name, (start, start + size))


def _mixer(symbol: str, f: Mapping) -> dict:
    if symbol == "G":
        kd = f["linear_num_key_heads"] * f["linear_key_head_dim"]
        vd = f["linear_num_value_heads"] * f["linear_value_head_dim"]
        qkv = {"query": _rows("linear_attn.in_proj_qkv.weight", 0, kd),
               "key": _rows("linear_attn.in_proj_qkv.weight", kd, kd),
               "value": _rows("linear_attn.in_proj_qkv.weight", 2 * kd, vd)}
        t = {f"self_attention.in_proj.weight.{part}": spec for part, spec in qkv.items()}
        t.update({"self_attention.in_proj.layer_norm_weight": Src("input_layernorm.weight"),
                  "self_attention.in_proj.weight.z": Src("linear_attn.in_proj_z.weight"),
                  "self_attention.in_proj.weight.beta": Src("linear_attn.in_proj_b.weight"),
                  "self_attention.in_proj.weight.alpha": Src("linear_attn.in_proj_a.weight"),
                  "self_attention.A_log": Src("linear_attn.A_log"),
                  "self_attention.dt_bias": Src("linear_attn.dt_bias"),
                  "self_attention.out_norm.weight": Src("linear_attn.norm.weight"),
                  "self_attention.out_proj.weight": Src("linear_attn.out_proj.weight")})
        t.update({f"self_attention.conv1d.weight.{part}": Src("linear_attn.conv1d.weight", spec.rows)
                  for part, spec in qkv.items()})
        return t
    heads, groups, d = f["num_attention_heads"], f["num_query_groups"], f["kv_channels"]
    per_group = heads // groups
    parts = []
    for g in range(groups):
        group_heads = range(g * per_group, (g + 1) * per_group)
        parts += [_rows("self_attn.q_proj.weight", 2 * h * d, d) for h in group_heads]  # queries
        parts += [_rows("self_attn.q_proj.weight", (2 * h + 1) * d, d) for h in group_heads]  # their gates
        parts += [_rows("self_attn.k_proj.weight", g * d, d), _rows("self_attn.v_proj.weight", g * d, d)]
    return {"self_attention.linear_qkv.layer_norm_weight": Src("input_layernorm.weight"),
            "self_attention.linear_qkv.weight": Cat(tuple(parts)),
            "self_attention.q_layernorm.weight": Src("self_attn.q_norm.weight"),
            "self_attention.k_layernorm.weight": Src("self_attn.k_norm.weight"),
            "self_attention.linear_proj.weight": Src("self_attn.o_proj.weight")}


def _swiglu(prefix: str, ffn: int) -> dict:
    gate, up = _rows(f"{prefix}gate_proj.weight", 0, ffn), _rows(f"{prefix}up_proj.weight", 0, ffn)
    return {"linear_fc1.weight": Cat((gate, up)),
            "linear_fc2.weight": Src(f"{prefix}down_proj.weight")}


def _mlp(f: Mapping) -> dict:
    if not f["num_experts"]:
        return {"mlp.linear_fc1.layer_norm_weight": Src("post_attention_layernorm.weight"),
                **{f"mlp.{k}": v for k, v in _swiglu("mlp.", f["ffn_hidden_size"]).items()}}
    experts = [_swiglu(f"mlp.experts.{e}.", f["moe_ffn_hidden_size"]) for e in range(f["num_experts"])]
    return {"pre_mlp_layernorm.weight": Src("post_attention_layernorm.weight"),
            "mlp.router.weight": Src("mlp.gate.weight"),
            **{f"mlp.experts.experts.{k}": Stack(tuple(e[k] for e in experts)) for k in experts[0]},
            **{f"mlp.shared_experts.{k}": v
               for k, v in _swiglu("mlp.shared_expert.", f["moe_shared_expert_intermediate_size"]).items()},
            "mlp.shared_experts.gate_weight": Src("mlp.shared_expert_gate.weight")}


def text_config(s) -> dict:
    """The `Qwen3_5ForCausalLM` (or MoE) config.json of settings `s`: what transformers reads back as the same
    model (config_fields of it gives `s`'s fields)."""
    moe = s.num_experts > 0
    config = dict(
        model_type=TEXT_TYPES[int(moe)], architectures=["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
        layer_types=[next(t for t, c in HF_LAYER_TYPES.items() if c == symbol) for symbol in s.layer_pattern],
        num_attention_heads=s.num_attention_heads, num_key_value_heads=s.num_query_groups, head_dim=s.kv_channels,
        linear_num_key_heads=s.linear_num_key_heads, linear_num_value_heads=s.linear_num_value_heads,
        linear_key_head_dim=s.linear_key_head_dim, linear_value_head_dim=s.linear_value_head_dim,
        linear_conv_kernel_dim=s.linear_conv_kernel, rms_norm_eps=s.norm_epsilon, hidden_act="silu",
        attention_bias=False, attention_dropout=s.dropout, initializer_range=s.init_method_std,
        tie_word_embeddings=s.tie_word_embeddings, max_position_embeddings=max(s.seq_length, 32768),
        rope_parameters={"rope_type": "default", "rope_theta": s.rotary_base,
                         "partial_rotary_factor": s.rotary_percent, "mrope_section": list(s.mrope_section),
                         "mrope_interleaved": True},
    )
    if moe:
        config.update(num_experts=s.num_experts, num_experts_per_tok=s.moe_router_topk,
                      moe_intermediate_size=s.moe_ffn_hidden_size,
                      shared_expert_intermediate_size=s.moe_shared_expert_intermediate_size,
                      router_aux_loss_coef=s.moe_aux_loss_coeff)
    else:
        config["intermediate_size"] = s.ffn_hidden_size
    return config
