"""Hugging Face NemotronH (`transformers.models.nemotron_h`) <-> megatron-core HybridModel: the hybrid Mamba / MoE /
attention language model of the Nemotron VLM family, alone.

Hugging Face names are a checkpoint's, as `save_pretrained` writes them and the hub holds them
(`backbone.layers.N.mixer.experts.E.up_proj.weight`, `lm_head.weight`). Keys are the HybridModel's dist-checkpoint
keys (what a mimo checkpoint saves, the same for the `local` and `te` backends): Mamba's `in_proj.weight` is saved
as five parts `.z .x .B .C .dt` and its conv1d as three `.x .B .C`, each a row window of the Hugging Face tensor;
each MoE layer's experts are one stacked key `mlp.experts.experts.linear_fc1.weight` [E, ffn, h].

Tensors keep their values and dtype; the one layout change is attention's: Hugging Face keeps separate q, k and v
projections, megatron one `linear_qkv` whose rows are grouped per key/value head, `[q heads of group g, k_g, v_g]`
for each group g (a TP rank holds whole groups, so its rows are a run of windows). Each layer's input norm is
megatron's norm fused into the layer's first linear (`...in_proj.layer_norm_weight`,
`...linear_qkv.layer_norm_weight`, `...linear_fc1.layer_norm_weight`), except in MoE layers (`pre_mlp_layernorm`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from mimo.errors import UsageError
from mimo.plugins.kit.tensor_map import Cat, LoadedModule, Src, Stack, TensorMap, prefixed

# layers_block_type entries -> the provider's hybrid_pattern symbols (and the legacy spellings transformers remaps).
LAYER_SYMBOLS = {"linear_attention": "M", "mamba": "M", "moe": "E", "full_attention": "*", "attention": "*",
                 "mlp": "-"}

# Config fields with a value the provider implements one way only: field -> (that value, which is also
# transformers' default, the layer kinds that use the field, what the value means).
FIXED_FIELDS = {
    "layer_norm_epsilon": (1e-5, "ME*-", "every RMSNorm (and Mamba's gated norm) uses eps 1e-5"),
    "mamba_hidden_act": ("silu", "M", "the Mamba convolution is followed by SiLU"),
    "use_conv_bias": (True, "M", "the Mamba convolution has a bias"),
    "use_bias": (False, "M", "the Mamba projections have no bias"),
    "mlp_hidden_act": ("relu2", "E-", "MLPs and experts use squared ReLU"),
    "mlp_bias": (False, "E-", "MLPs and experts have no bias"),
    "moe_latent_size": (None, "E", "experts work at the hidden size, with no latent projection"),
    "n_group": (1, "E", "routing is not group-limited"),
    "norm_topk_prob": (True, "E", "megatron-core normalizes sigmoid routing weights over the top k"),
}

# Legacy spellings of config fields (NVIDIA's remote-code configs), as NemotronHConfig still reads them.
LEGACY_FIELDS = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_min": "time_step_min",
                 "mamba_conv_bias": "use_conv_bias"}

# Checkpoint tensors that the reference model does not load (multi-token prediction heads).
IGNORED_PREFIXES = ("mtp.",)


# ---------------------------------------------------------------------------------------------------- config


def layer_pattern(hf_config: Mapping) -> str:
    """The hybrid_pattern (M, E, *, -) of `layers_block_type`, or of the legacy `hybrid_override_pattern`."""
    types = hf_config.get("layers_block_type") or hf_config.get("layer_types")
    if types is None:
        pattern = hf_config.get("hybrid_override_pattern")
        if not pattern or set(pattern) - set(LAYER_SYMBOLS.values()):
            raise UsageError(f"Hugging Face config hybrid_override_pattern={pattern!r} is not a pattern of M, E, * "
                             f"and - (and there is no layers_block_type)")
        return pattern
    unknown = sorted(set(types) - set(LAYER_SYMBOLS))
    if unknown:
        raise UsageError(f"Hugging Face config layers_block_type has {unknown}: the provider builds "
                         f"{', '.join(sorted(set(LAYER_SYMBOLS)))} layers")
    return "".join(LAYER_SYMBOLS[t] for t in types)


def config_fields(hf_config: Mapping) -> dict:
    """The provider's LLM settings (NemotronVLMSettings fields) of a NemotronH config.json. A field whose value the
    provider cannot express raises UsageError, one line naming the field and the value. Fields of layer kinds the
    pattern does not use are left out (the provider's defaults stand)."""
    cfg = {LEGACY_FIELDS.get(k, k): v for k, v in hf_config.items()}
    if cfg.get("model_type", "nemotron_h") != "nemotron_h":
        raise UsageError(f"Hugging Face config model_type={cfg['model_type']!r} is not nemotron_h")
    pattern = layer_pattern(cfg)
    _check_fixed_fields(cfg, pattern)

    def need(field):
        if cfg.get(field) is None:
            raise UsageError(f"Hugging Face config has no {field}, which the layer pattern {pattern!r} needs")
        return cfg[field]

    hidden_dropout, attention_dropout = cfg.get("hidden_dropout", 0.0), cfg.get("attention_dropout", 0.0)
    if hidden_dropout != attention_dropout:
        raise UsageError(f"Hugging Face config attention_dropout={attention_dropout} differs from hidden_dropout="
                         f"{hidden_dropout}: the provider has one dropout setting")
    # tie_word_embeddings is not read: NemotronHForCausalLM never ties (no _tied_weights_keys), and neither does
    # the provider; lm_head.weight is always a tensor of its own.
    fields = dict(hybrid_pattern=pattern, hidden_size=need("hidden_size"), vocab_size=need("vocab_size"),
                  dropout=float(hidden_dropout))
    if "initializer_range" in cfg:
        fields["init_method_std"] = cfg["initializer_range"]
    if "*" in pattern:
        heads = need("num_attention_heads")
        fields.update(num_attention_heads=heads, num_query_groups=cfg.get("num_key_value_heads") or heads,
                      kv_channels=cfg.get("head_dim") or fields["hidden_size"] // heads)
    if "M" in pattern:
        fields.update(mamba_num_heads=need("mamba_num_heads"), mamba_head_dim=need("mamba_head_dim"),
                      mamba_num_groups=need("n_groups"), mamba_state_dim=need("ssm_state_size"),
                      mamba_conv_kernel=need("conv_kernel"),
                      # The reference clamps the step size at time_step_min from below (whatever time_step_limit
                      # says); megatron-core's MambaMixer does not clamp, mimo's local mixer can.
                      mamba_dt_clamp_min=float(cfg.get("time_step_min", 0.001)))
    if "E" in pattern:
        topk = need("num_experts_per_tok")
        if topk == 1:  # the reference then normalizes the one weight to 1; megatron-core keeps the sigmoid
            raise UsageError("Hugging Face config num_experts_per_tok=1 with norm_topk_prob: megatron-core does not "
                             "normalize a single sigmoid routing weight")
        fields.update(num_experts=need("n_routed_experts"), moe_router_topk=topk,
                      moe_ffn_hidden_size=need("moe_intermediate_size"),
                      moe_shared_expert_intermediate_size=need("moe_shared_expert_intermediate_size"),
                      moe_router_topk_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
    if "-" in pattern:
        fields["ffn_hidden_size"] = need("intermediate_size")
    return fields


def _check_fixed_fields(cfg: Mapping, pattern: str) -> None:
    for field, (value, kinds, meaning) in FIXED_FIELDS.items():
        given = cfg.get(field, value)
        if set(kinds) & set(pattern) and given != value:
            raise UsageError(f"Hugging Face config {field}={given!r} is not supported: {meaning} "
                             f"({field}={value!r})")


# ------------------------------------------------------------------------------------------------- tensor map

# layers_block_type names of the provider's layer symbols (as NemotronHConfig writes them).
LAYER_TYPES = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}


def tensor_map(f: Mapping) -> TensorMap:
    """Where each dist-checkpoint key of the language model (relative to it: `decoder.layers.N....`) is in a
    NemotronH checkpoint, for settings `f` (a mapping of NemotronVLMSettings fields)."""
    t = {"embedding.word_embeddings.weight": Src("backbone.embeddings.weight"),
         "decoder.final_norm.weight": Src("backbone.norm_f.weight"),
         "output_layer.weight": Src("lm_head.weight")}
    for i, symbol in enumerate(f["hybrid_pattern"]):
        t.update({f"decoder.layers.{i}.{key}": prefixed(spec, f"backbone.layers.{i}.")
                  for key, spec in _layer(symbol, f).items()})
    return TensorMap(t, covers=("",), ignored=IGNORED_PREFIXES)



def _layer(symbol: str, f: Mapping) -> dict:
    """One layer's keys and specs, relative to `decoder.layers.N.` and `backbone.layers.N.`."""
    if symbol == "M":
        inner, groups = f["mamba_num_heads"] * f["mamba_head_dim"], f["mamba_num_groups"] * f["mamba_state_dim"]
        rows = _windows(z=inner, x=inner, B=groups, C=groups, dt=f["mamba_num_heads"])
        conv = _windows(x=inner, B=groups, C=groups)
        t = {"mixer.in_proj.layer_norm_weight": Src("norm.weight")}
        t.update({f"mixer.in_proj.weight.{part}": Src("mixer.in_proj.weight", w) for part, w in rows.items()})
        for kind in ("weight", "bias"):
            t.update({f"mixer.conv1d.{kind}.{part}": Src(f"mixer.conv1d.{kind}", w) for part, w in conv.items()})
        t.update({f"mixer.{name}": Src(f"mixer.{name}") for name in ("dt_bias", "A_log", "D", "norm.weight",
                                                                       "out_proj.weight")})
        return t
    if symbol == "*":
        heads, groups, d = f["num_attention_heads"], f["num_query_groups"], f["kv_channels"]
        q = heads // groups * d
        parts = []
        for g in range(groups):
            parts += [Src("mixer.q_proj.weight", (g * q, (g + 1) * q)), Src("mixer.k_proj.weight", (g * d, (g + 1) * d)),
                      Src("mixer.v_proj.weight", (g * d, (g + 1) * d))]
        return {"self_attention.linear_qkv.layer_norm_weight": Src("norm.weight"),
                "self_attention.linear_qkv.weight": Cat(tuple(parts)),
                "self_attention.linear_proj.weight": Src("mixer.o_proj.weight")}
    if symbol == "E":
        experts = range(f["num_experts"])
        return {"pre_mlp_layernorm.weight": Src("norm.weight"), "mlp.router.weight": Src("mixer.gate.weight"),
                "mlp.router.expert_bias": Src("mixer.gate.e_score_correction_bias"),
                "mlp.shared_experts.linear_fc1.weight": Src("mixer.shared_experts.up_proj.weight"),
                "mlp.shared_experts.linear_fc2.weight": Src("mixer.shared_experts.down_proj.weight"),
                "mlp.experts.experts.linear_fc1.weight": Stack(tuple(Src(f"mixer.experts.{e}.up_proj.weight")
                                                                     for e in experts)),
                "mlp.experts.experts.linear_fc2.weight": Stack(tuple(Src(f"mixer.experts.{e}.down_proj.weight")
                                                                     for e in experts))}
    return {"mlp.linear_fc1.layer_norm_weight": Src("norm.weight"), "mlp.linear_fc1.weight": Src("mixer.up_proj.weight"),
            "mlp.linear_fc2.weight": Src("mixer.down_proj.weight")}


def _windows(**sizes: int) -> dict[str, tuple[int, int]]:
    """Consecutive row windows of the given sizes, by name."""
    out, start = {}, 0
    for name, size in sizes.items():
        out[name] = (start, start + size)
        start += size
    return out


def text_config(s) -> dict:
    """The NemotronH config.json of settings `s` (the omni model's text_config)."""
    return dict(
        model_type="nemotron_h", architectures=["NemotronHForCausalLM"],
        layers_block_type=[LAYER_TYPES[c] for c in s.hybrid_pattern],
        hidden_size=s.hidden_size, vocab_size=s.vocab_size, hidden_dropout=s.dropout, attention_dropout=s.dropout,
        initializer_range=s.init_method_std, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_query_groups, head_dim=s.kv_channels, mamba_num_heads=s.mamba_num_heads,
        mamba_head_dim=s.mamba_head_dim, n_groups=s.mamba_num_groups, ssm_state_size=s.mamba_state_dim,
        conv_kernel=s.mamba_conv_kernel, n_routed_experts=s.num_experts, num_experts_per_tok=s.moe_router_topk,
        moe_intermediate_size=s.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=s.moe_shared_expert_intermediate_size,
        routed_scaling_factor=s.moe_router_topk_scaling_factor, intermediate_size=s.ffn_hidden_size,
        tie_word_embeddings=False, num_nextn_predict_layers=0,
        time_step_min=s.mamba_dt_clamp_min)  # the reference clamps dt at time_step_min, mimo at mamba_dt_clamp_min


# ------------------------------------------------------------------------------------------------ loaded models

EXPERT_PARAMETERS = ("up_proj", "down_proj")  # NemotronHExperts' 3-D parameters [E, out, in], in its order
_EXPERT_WEIGHT = re.compile(r"backbone\.(layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight")


def loaded_module(name: str) -> tuple[LoadedModule, ...] | str:
    """The module of transformers' NemotronHForCausalLM that holds the checkpoint weight `name` once loaded
    (`backbone.` is `model.` there); a routed expert's weight is a row of its layer's 3-D `mixer.experts.up_proj`
    or `down_proj`."""
    expert = _EXPERT_WEIGHT.fullmatch(name)
    if expert is not None:
        return (LoadedModule(f"model.{expert[1]}", parameter=expert[3], expert=int(expert[2]),
                             parameters=EXPERT_PARAMETERS),)
    if not name.endswith(".weight"):
        return "no linear's weight"
    path = name.removesuffix(".weight")
    return (LoadedModule("model." + path.removeprefix("backbone.") if path.startswith("backbone.") else path),)


def _checkpoint_layout(hf_state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """`hf_state` with checkpoint names. A loaded model's state dict (`model.` prefix, experts stacked as
    `mixer.experts.up_proj [E, ffn, h]`) is renamed and unstacked; a checkpoint's is returned as it is (lazy)."""
    if not any(name.startswith("model.") for name in hf_state):
        return hf_state
    out = {}
    for name, tensor in hf_state.items():
        name = "backbone." + name.removeprefix("model.") if name.startswith("model.") else name
        stem, _, linear = name.rpartition(".")
        if stem.endswith(".mixer.experts") and linear in ("up_proj", "down_proj"):
            out.update({f"{stem}.{e}.{linear}.weight": t for e, t in enumerate(tensor.unbind(0))})
        else:
            out[name] = tensor
    return out
