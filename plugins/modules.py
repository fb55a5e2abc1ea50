"""Module names: the language model's, and where each module's parameters sit in megatron-core's MimoModel.

A provider names its modules in `model_shape` (the language model under `LANGUAGE`, each encoder module by its
modality) and passes the same names to `ctx.transformer_config`, `ctx.pg_collection` and the stage checks.
Parameter names (`frozen_parameters`, `hf_tensor_map`, checkpoints) put a module's parameters under
`module_prefix(name)`: MimoModel keeps the language model as `language_model` and each modality's submodules
under `modality_submodules.<modality>`.
"""

LANGUAGE = "language"  # megatron-core's MIMO_LANGUAGE_MODULE_KEY


def module_prefix(module: str) -> str:
    """The state-dict prefix of `module`'s parameters in MimoModel: `language_model.` for the language model,
    `modality_submodules.<module>.` for an encoder module (then `encoders.<encoder>.` or `input_projections.`)."""
    return "language_model." if module == LANGUAGE else f"modality_submodules.{module}."
