"""How `export-hf --adapter-only` places one adapter (core/checkpoint/peft_export.py), on tensor maps of the kinds
providers declare: each loaded module's B A is exactly the rows of the adapter's B A that the map gives its weight
(fused outputs split, stacked layers and experts one module each, an adapter shared by experts on every one), and
a weight no module holds is one line naming the way out; experts' adapters in PEFT's layout for 3-D parameters."""

from __future__ import annotations

import pytest
import torch

from mimo.core.checkpoint.peft_experts import expert_tensors
from mimo.core.checkpoint.peft_export import Adapter, place
from mimo.errors import UsageError
from mimo.plugins.kit.tensor_map import Cat, LoadedModule, Src, Stack, TensorMap, to_hf

RANK, HIDDEN, LAYERS, HEADS, D = 2, 8, 2, 2, 4


def _delta_rows(tmap: TensorMap, key: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors the map makes of B A (what merging adds to the weight)."""
    return to_hf(TensorMap({key: tmap.tensors[key]}), {key: b @ a})


def test_a_fused_qkv_of_stacked_layers_splits_b_and_shares_a():
    # megatron's rows per head [q_h; k_h; v_h], the checkpoint's one fused qkv [q heads; k heads; v heads] per
    # layer, which transformers splits into three modules on load (RADIO's layout)
    key = "decoder.layers.self_attention.linear_qkv.weight"
    tmap = TensorMap({key: Stack(tuple(
        Cat(tuple(Src(f"blocks.{i}.qkv.weight", (w * HEADS * D + h * D, w * HEADS * D + (h + 1) * D))
                  for h in range(HEADS) for w in range(3))) for i in range(LAYERS)))})

    def loaded(name):
        layer = name.split(".")[1]
        return tuple(LoadedModule(f"layer.{layer}.{p}_proj", (i * HEADS * D, (i + 1) * HEADS * D))
                     for i, p in enumerate("qkv"))

    a, b = torch.randn(LAYERS, RANK, HIDDEN), torch.randn(LAYERS, 3 * HEADS * D, RANK)
    placed = place(Adapter("qkv", key), tmap, loaded, a, [b], "MERGE")
    assert sorted(placed) == [f"layer.{i}.{p}_proj" for i in range(LAYERS) for p in "kqv"]
    delta = _delta_rows(tmap, key, a, b)
    for i in range(LAYERS):
        for j, p in enumerate("qkv"):
            module_a, module_b = placed[f"layer.{i}.{p}_proj"]
            assert torch.equal(module_a, a[i])  # the input side: whole, the same for q, k and v
            rows = delta[f"blocks.{i}.qkv.weight"][j * HEADS * D:(j + 1) * HEADS * D]
            torch.testing.assert_close(module_b @ module_a, rows)


def test_experts_get_their_own_adapter_or_the_shared_one_where_each_has_a_module():
    key, experts = "mlp.experts.experts.linear_fc1.weight", 3
    tmap = TensorMap({key: Stack(tuple(Src(f"experts.{e}.up.weight") for e in range(experts)))})

    def loaded(name):
        return (LoadedModule(name.removesuffix(".weight")),)

    per_a, per_b = torch.randn(experts, RANK, HIDDEN), torch.randn(experts, 16, RANK)
    placed = place(Adapter("experts", key), tmap, loaded, per_a, [per_b], "MERGE")
    for e in range(experts):
        assert torch.equal(placed[f"experts.{e}.up"][0], per_a[e]) and torch.equal(placed[f"experts.{e}.up"][1],
                                                                                    per_b[e])
    shared_a, shared_b = torch.randn(RANK, HIDDEN), torch.randn(16, RANK)
    placed = place(Adapter("experts (shared)", key), tmap, loaded, shared_a, [shared_b], "MERGE")
    assert len(placed) == experts and all(torch.equal(a, shared_a) and torch.equal(b, shared_b)
                                          for a, b in placed.values())


def test_b_saved_in_parts_lands_in_the_rows_of_its_parts():
    # Mamba's in_proj: saved as row windows of one Hugging Face tensor, B part by part
    keys = {"in_proj.weight.z": (0, 6), "in_proj.weight.x": (6, 10)}
    tmap = TensorMap({k: Src("mixer.in_proj.weight", rows) for k, rows in keys.items()})
    a, parts = torch.randn(RANK, HIDDEN), [torch.randn(6, RANK), torch.randn(4, RANK)]
    placed = place(Adapter("in_proj", "in_proj.weight"), tmap, lambda n: (LoadedModule("mixer.in_proj"),), a, parts,
                   "MERGE")
    assert torch.equal(placed["mixer.in_proj"][1], torch.cat(parts))


def test_a_weight_no_module_holds_is_one_line_with_the_way_out():
    tmap = TensorMap({"experts.weight": Stack((Src("experts.0.up.weight"),))})
    with pytest.raises(UsageError) as refused:
        place(Adapter("layer 2's experts", "experts.weight"), tmap, lambda n: "loaded as one 3-D tensor",
              torch.randn(RANK, HIDDEN), [torch.randn(4, RANK)], "mimo ckpt merge-lora A M, then export-hf M O")
    assert str(refused.value) == (
        "--adapter-only: the adapter on layer 2's experts cannot be exported to PEFT (experts.0.up.weight: loaded as "
        "one 3-D tensor); export the merged model instead: mimo ckpt merge-lora A M, then export-hf M O")


def test_expert_adapters_take_pefts_layout_for_3d_parameters():
    """Per-expert adapters of a layer's two expert linears, written as peft_experts.expert_tensors writes them, load
    into PEFT's ParamWrappers on transformers' NemotronHExperts under the names PEFT gives them, and PEFT's delta
    for each expert is that expert's scale * B_e A_e."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    experts, hidden, ffn, alpha = 3, 8, 12, 6.0
    holder = torch.nn.Module()
    holder.mixer = torch.nn.Module()
    holder.mixer.experts = NemotronHExperts(NemotronHConfig(hidden_size=hidden, moe_intermediate_size=ffn,
                                                            n_routed_experts=experts))
    generator = torch.Generator().manual_seed(0)
    shapes = {"up_proj": (ffn, hidden), "down_proj": (hidden, ffn)}
    pairs = {p: [(torch.randn(RANK, i, generator=generator), torch.randn(o, RANK, generator=generator))
                 for _ in range(experts)] for p, (o, i) in shapes.items()}
    rows = {LoadedModule("mixer.experts", parameter=p, expert=e, parameters=("up_proj", "down_proj")): pairs[p][e]
            for p in shapes for e in range(experts)}
    targets, tensors = expert_tensors(rows)
    assert targets == ["mixer.experts.down_proj", "mixer.experts.up_proj"]

    model = get_peft_model(holder, LoraConfig(r=RANK, lora_alpha=alpha, target_parameters=targets))
    names = set(get_peft_model_state_dict(model))
    assert names == set(tensors)  # the nesting PEFT builds names them as written
    result = set_peft_model_state_dict(model, tensors)
    assert not result.unexpected_keys
    wrapper = model.base_model.model.mixer.experts
    for parameter, layer in (("down_proj", wrapper), ("up_proj", wrapper.base_layer)):
        assert layer.parameter_name == parameter
        want = torch.stack([alpha / RANK * b @ a for a, b in pairs[parameter]])
        torch.testing.assert_close(layer.get_delta_weight("default"), want)


def test_a_3d_parameter_adapted_for_some_experts_only_is_one_line():
    pair = (torch.randn(RANK, HIDDEN), torch.randn(4, RANK))
    rows = {LoadedModule("mixer.experts", parameter="up_proj", expert=e): pair for e in (0, 2)}
    with pytest.raises(UsageError) as refused:
        expert_tensors(rows)
    assert str(refused.value) == ("--adapter-only: mixer.experts.up_proj has adapters for some experts only (none for "
                                  "expert 1); PEFT adapts every expert of a 3-D parameter")
