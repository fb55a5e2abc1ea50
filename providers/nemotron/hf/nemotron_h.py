"""Hugging Face NemotronH (`transformers.models.nemotron_h`) <-> megatron-core HybridModel: the hybrid Mamba / MoE /
attention language model of the Nemotron VLM family, alone.

Hugging Face names are a checkpoint's, as `save_pretrained` writes them and the hub holds them
(`backbone.layers.N.mixer.experts.E.up_proj.weight`, `lm_head.weight`); `to_megatron` also takes a loaded model's
own state dict (`model.` prefix, each layer's experts stacked in one tensor). Megatron names are
`HybridModel.state_dict()`'s at TP1 / PP1, which mimo's `local` and `te` backends share except for the routed
experts: `experts="sequential"` (megatron's SequentialMLP, the local backend) names them
`mlp.experts.local_experts.E.linear_fc1.weight`, `experts="grouped"` (TEGroupedMLP) `mlp.experts.linear_fc1.weightE`.

Tensors are renamed and never cast; the one layout change is attention's: Hugging Face keeps separate q, k and v
projections, megatron one `linear_qkv` whose rows are grouped per key/value head, `[q heads of group g, k_g, v_g]`
for each group g. Each layer's input norm is megatron's norm fused into the layer's first linear
(`...in_proj.layer_norm_weight`, `...linear_qkv.layer_norm_weight`, `...linear_fc1.layer_norm_weight`), except in
MoE layers (`pre_mlp_layernorm.weight`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from mimo.errors import UsageError

Experts = Literal["sequential", "grouped"]

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


# ------------------------------------------------------------------------------------------------ tensor names


def _expert(e: int, linear: str, experts: Experts) -> str:
    if experts == "grouped":
        return f"mlp.experts.{linear}.weight{e}"
    return f"mlp.experts.local_experts.{e}.{linear}.weight"


def _layer_renames(symbol: str, fields: dict, experts: Experts) -> list[tuple[str, str]]:
    """(Hugging Face name, megatron name) of one layer's tensors that are copied as they are, relative to the
    layer (`backbone.layers.N.` and `decoder.layers.N.`)."""
    if symbol == "M":  # in_proj rows are [z, x, B, C, dt] and conv channels [x, B, C] in both
        return [("norm.weight", "mixer.in_proj.layer_norm_weight"), ("mixer.in_proj.weight", "mixer.in_proj.weight"),
                ("mixer.conv1d.weight", "mixer.conv1d_weight"), ("mixer.conv1d.bias", "mixer.conv1d_bias"),
                ("mixer.dt_bias", "mixer.dt_bias"), ("mixer.A_log", "mixer.A_log"), ("mixer.D", "mixer.D"),
                ("mixer.norm.weight", "mixer.norm.weight"), ("mixer.out_proj.weight", "mixer.out_proj.weight")]
    if symbol == "*":  # q_proj, k_proj and v_proj: see _fuse_qkv
        return [("norm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                ("mixer.o_proj.weight", "self_attention.linear_proj.weight")]
    if symbol == "E":
        routed = [(f"mixer.experts.{e}.{hf}.weight", _expert(e, mg, experts))
                  for e in range(fields["num_experts"]) for hf, mg in (("up_proj", "linear_fc1"),
                                                                         ("down_proj", "linear_fc2"))]
        return [("norm.weight", "pre_mlp_layernorm.weight"), ("mixer.gate.weight", "mlp.router.weight"),
                ("mixer.gate.e_score_correction_bias", "mlp.router.expert_bias"),
                ("mixer.shared_experts.up_proj.weight", "mlp.shared_experts.linear_fc1.weight"),
                ("mixer.shared_experts.down_proj.weight", "mlp.shared_experts.linear_fc2.weight"), *routed]
    return [("norm.weight", "mlp.linear_fc1.layer_norm_weight"), ("mixer.up_proj.weight", "mlp.linear_fc1.weight"),
            ("mixer.down_proj.weight", "mlp.linear_fc2.weight")]


def _renames(fields: dict, experts: Experts) -> list[tuple[str, str]]:
    """(Hugging Face name, megatron name) of every tensor copied as it is."""
    pairs = [("backbone.embeddings.weight", "embedding.word_embeddings.weight")]
    for i, symbol in enumerate(fields["hybrid_pattern"]):
        pairs += [(f"backbone.layers.{i}.{hf}", f"decoder.layers.{i}.{mg}")
                  for hf, mg in _layer_renames(symbol, fields, experts)]
    return pairs + [("backbone.norm_f.weight", "decoder.final_norm.weight"), ("lm_head.weight", "output_layer.weight")]


def _attention_layers(fields: dict) -> list[int]:
    return [i for i, symbol in enumerate(fields["hybrid_pattern"]) if symbol == "*"]


# ---------------------------------------------------------------------------------------------- attention qkv


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fields: dict) -> torch.Tensor:
    """q [heads * d, h], k and v [groups * d, h] -> megatron's linear_qkv [groups * (heads/groups + 2) * d, h]."""
    heads, groups, d = fields["num_attention_heads"], fields["num_query_groups"], fields["kv_channels"]
    if q.shape[0] != heads * d or k.shape[0] != groups * d or v.shape[0] != groups * d:
        raise UsageError(f"attention projections q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                         f"hold {heads} query and {groups} key/value heads of {d}")
    return torch.cat([t.reshape(groups, -1, q.shape[-1]) for t in (q, k, v)], dim=1).reshape(-1, q.shape[-1])


def _split_qkv(qkv: torch.Tensor, fields: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's linear_qkv -> q, k, v (contiguous copies: the same bits)."""
    groups, d = fields["num_query_groups"], fields["kv_channels"]
    q_rows = fields["num_attention_heads"] // groups * d
    q, k, v = qkv.reshape(groups, q_rows + 2 * d, qkv.shape[-1]).split([q_rows, d, d], dim=1)
    return tuple(t.reshape(-1, qkv.shape[-1]).contiguous() for t in (q, k, v))


# ------------------------------------------------------------------------------------------------- conversion


def to_megatron(hf_state: Mapping[str, torch.Tensor], hf_config: Mapping,
                experts: Experts = "sequential") -> dict[str, torch.Tensor]:
    """A NemotronH checkpoint's tensors (read lazily from `hf_state`) -> HybridModel state-dict tensors. Every
    tensor of `hf_state` is used (multi-token-prediction heads `mtp.*` aside, which the reference ignores too),
    and every one the model needs must be there."""
    if experts not in ("sequential", "grouped"):
        raise ValueError(f"experts must be 'sequential' or 'grouped', got {experts!r}")
    fields = config_fields(hf_config)
    source = _Taken(_checkpoint_layout(hf_state))
    state = {mg: source[hf] for hf, mg in _renames(fields, experts)}
    for i in _attention_layers(fields):
        q, k, v = (source[f"backbone.layers.{i}.mixer.{p}_proj.weight"] for p in "qkv")
        state[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = _fuse_qkv(q, k, v, fields)
    source.check_all_taken()
    return state


def from_megatron(state: Mapping[str, torch.Tensor], hf_config: Mapping) -> dict[str, torch.Tensor]:
    """HybridModel state-dict tensors (either experts layout; `_extra_state` entries are skipped) -> a NemotronH
    checkpoint's tensors, named as `save_pretrained` writes them."""
    fields = config_fields(hf_config)
    grouped = any(name.startswith("decoder.layers.") and ".mlp.experts.linear_fc1.weight" in name for name in state)
    source = _Taken({k: v for k, v in state.items() if not k.endswith("._extra_state")}, side="megatron")
    out = {hf: source[mg] for hf, mg in _renames(fields, "grouped" if grouped else "sequential")}
    for i in _attention_layers(fields):
        qkv = _split_qkv(source[f"decoder.layers.{i}.self_attention.linear_qkv.weight"], fields)
        out.update({f"backbone.layers.{i}.mixer.{p}_proj.weight": t for p, t in zip("qkv", qkv)})
    source.check_all_taken()
    return out


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


class _Taken:
    """A mapping's tensors handed out by name, remembering which were asked for: a tensor the conversion does not
    use, or one it needs and cannot find, is a wrong configuration or a different model, never silently right."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], side: str = "Hugging Face"):
        self.tensors, self.side, self.names, self.taken = tensors, side, set(tensors), set()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise UsageError(f"the {self.side} state has no {name} (does its config match the checkpoint?)")
        self.taken.add(name)
        return self.tensors[name]

    def check_all_taken(self) -> None:
        unused = sorted(n for n in self.names - self.taken if not n.startswith(IGNORED_PREFIXES))
        if unused:
            more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
            raise UsageError(f"the {self.side} state has tensors the config does not describe: "
                             f"{', '.join(unused[:3])}{more}")
