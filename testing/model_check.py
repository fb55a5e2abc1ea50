"""`model_shape`, `build_encoders` and `build_language_model` return what the loop builds a MimoModel from.

The build hooks are called as on a rank that holds no module (every `ctx.pg_collection(...)` is None, which a
heterogeneous layout does on the ranks of the other modules), so no process group is needed here; the model
itself is built and trained by `train_check` in a process of its own.
"""

from __future__ import annotations

import inspect

import torch

from mimo.plugins import LANGUAGE, BuildContext, Encoder, ModuleShape

from .report import ContractError, ModuleReport
from .subject import Subject

NO_MODULE_HELD = " (called as on a rank that holds no module: every ctx.pg_collection(...) is None)"


def check_model_shape(subject: Subject) -> dict[str, ModuleShape]:
    """`{module: ModuleShape}` with "language" among them and sane, positive numbers."""
    shapes = subject.call("model_shape", settings=subject.settings)
    if not isinstance(shapes, dict) or not all(isinstance(s, ModuleShape) for s in shapes.values()):
        raise ContractError("model_shape", f"must return {{module name: mimo.ModuleShape}}, got {_describe(shapes)}")
    if LANGUAGE not in shapes:
        raise ContractError("model_shape", f"declared modules {sorted(shapes)} lack the language model "
                                           f"(key '{LANGUAGE}')")
    for name, shape in shapes.items():
        for what in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(shape, what)
            if not isinstance(value, int) or value < 1:
                raise ContractError("model_shape", f"'{name}'.{what} must be a positive integer, got {value!r}")
        for what in ("num_query_groups", "num_experts", "num_parameters", "num_active_parameters"):
            value = getattr(shape, what)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ContractError("model_shape", f"'{name}'.{what} must be None or a positive integer, "
                                                   f"got {value!r}")
        if shape.num_query_groups and shape.num_attention_heads % shape.num_query_groups:
            raise ContractError("model_shape", f"'{name}': {shape.num_query_groups} query groups do not divide "
                                               f"{shape.num_attention_heads} attention heads")
        active, total = shape.num_active_parameters, shape.num_parameters
        if active is not None and total is not None and active > total:
            raise ContractError("model_shape", f"'{name}': {active:,} active parameters exceed the {total:,} total")
    return shapes


def module_reports(shapes: dict[str, ModuleShape]) -> dict[str, ModuleReport]:
    return {name: ModuleReport(s.num_layers, s.hidden_size, s.num_attention_heads, s.num_parameters)
            for name, s in shapes.items()}


def static_build_context(shapes: dict[str, ModuleShape]) -> BuildContext:
    """A world-of-one BuildContext in fp32 whose ranks hold no module: specs can be built, modules cannot."""
    from mimo.core.parallel import layout
    from mimo.core.config import LayoutOptions

    parallelism = layout.plan(LayoutOptions(), 1, shapes, micro_batch_size=1)
    return BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections={})


def check_specs(subject: Subject, shapes: dict[str, ModuleShape]) -> tuple[dict[str, Encoder], object]:
    """`build_encoders` gives one mimo.Encoder per non-language module of model_shape, `build_language_model` a
    megatron-core ModuleSpec. Returns both."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    ctx = static_build_context(shapes)
    encoders = subject.call("build_encoders", NO_MODULE_HELD, settings=subject.settings, ctx=ctx)
    if not isinstance(encoders, dict) or not all(isinstance(e, Encoder) for e in encoders.values()):
        raise ContractError("build_encoders", f"must return {{modality name: mimo.Encoder}}, got {_describe(encoders)}")
    declared = sorted(set(shapes) - {LANGUAGE})
    if sorted(encoders) != declared:
        raise ContractError("build_encoders", f"returned modules {sorted(encoders)} but model_shape declared "
                                              f"{declared}")
    for name, encoder in encoders.items():
        if not isinstance(encoder.spec, ModuleSpec):
            raise ContractError("build_encoders", f"'{name}': Encoder.spec must be a megatron-core ModuleSpec "
                                                  f"(e.g. of VisionModalitySubmodules), got {_describe(encoder.spec)}")
        token = encoder.placeholder_token_id
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ContractError("build_encoders", f"'{name}': placeholder_token_id must be a token id (int >= 0), "
                                                  f"got {token!r}")
    tokens = [e.placeholder_token_id for e in encoders.values()]
    if len(set(tokens)) != len(tokens):
        raise ContractError("build_encoders", f"modalities share a placeholder token id: "
                                              f"{ {n: e.placeholder_token_id for n, e in encoders.items()} }")
    language = subject.call("build_language_model", NO_MODULE_HELD, settings=subject.settings, ctx=ctx)
    if not isinstance(language, ModuleSpec):
        raise ContractError("build_language_model", f"must return a megatron-core ModuleSpec (e.g. of GPTModel), "
                                                    f"got {_describe(language)}")
    vocab = vocab_size(language)
    for name, token in zip(encoders, tokens):
        if vocab is not None and token >= vocab:
            raise ContractError("build_encoders", f"'{name}': placeholder_token_id {token} is outside the language "
                                                  f"model's vocabulary of {vocab}")
    return encoders, language


def vocab_size(language_spec) -> int | None:
    params = getattr(language_spec, "params", None) or {}
    return params.get("vocab_size")


def encoder_arguments(encoder: Encoder) -> dict[str, set[str] | None]:
    """`{encoder name: its forward's argument names}` from a ModalitySubmodules spec; None: takes **kwargs."""
    submodules = getattr(encoder.spec, "submodules", None) or {}
    found = {}
    for name, spec in (submodules.get("encoders") or {}).items():
        module = getattr(spec, "module", spec)
        forward = getattr(module, "forward", None)
        if forward is None:
            found[name] = None
            continue
        params = inspect.signature(forward).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        found[name] = None if takes_any else set(params) - {"self"}
    return found


def _describe(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {type(v).__name__}" for k, v in list(value.items())[:4]) + "}"
    return type(value).__name__
