"""Every hook a mimo plugin can implement. A provider implements the first five; the rest have defaults or are
optional.

Hooks that build or feed the model are `firstresult`: the loop calls them only on the chosen provider's plugin
(plus plugins that register no provider, which may extend any model), so an implementation never checks names.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("mimo")
hookimpl = pluggy.HookimplMarker("mimo")


@hookspec
def register_providers():
    """Return the providers this plugin implements: a list of `mimo.Provider`."""


@hookspec(firstresult=True)
def model_shape(settings):
    """Return `{module name: ModuleShape}` for every module, the language model under `mimo.LANGUAGE`.

    Called before any process group exists: layout validation and `mimo plan` read it.
    """


@hookspec(firstresult=True)
def build_encoders(settings, ctx):
    """Return `{modality name: Encoder}`: each a megatron-core ModalitySubmodules spec and its placeholder token.

    `ctx` is a `BuildContext`: `ctx.transformer_config(module, ...)` and `ctx.pg_collection(module)`.
    """


@hookspec(firstresult=True)
def build_language_model(settings, ctx):
    """Return the language model's megatron-core ModuleSpec (e.g. GPTModel with its layer spec)."""


@hookspec(firstresult=True)
def data_provider(settings, ctx):
    """Return the micro-batches for this rank's data lane (`ctx` is a `DataContext`): a `mimo.plugins.DataSource`
    (an iterator with the optional capabilities the loop uses: resumable state, data counts, ...), or a plain
    iterator or generator, which the loop wraps as a DataSource with no capability.

    A micro-batch is a dict: input_ids, labels, loss_mask, position_ids as [micro_batch_size, seq] tensors (position_ids
    may have position axes in front, [axes, micro_batch_size, seq]: a multimodal RoPE's temporal, height and width
    positions, which the loop passes to the language model as they are), and modality_inputs {modality: {encoder:
    {argument: tensor}}} for the samples' images.

    With `--data` (`ctx.data_path`), read that dataset (`ctx.energon_loader`, `mimo.plugins.data`) or raise
    `mimo.errors.UsageError`; never fall back to other data.
    """


@hookspec(firstresult=True)
def concat_encoder_inputs(settings, modality, inputs):
    """Return one input for `modality`'s encoders that stands for `inputs` one after another: `inputs` is a list of
    micro-batches' `modality_inputs[modality]` ({encoder: {argument: value}}: tensors already on the run's device
    in the model's dtype, except what describes the batch, `imgs_sizes` and PackedSeqParams, left on the host), and
    the encoders' output for the result must be their outputs for each of `inputs`, concatenated in order (true of
    encoders that treat every image on its own: `FixedTiles.concat`, `DynamicResolution.concat` in
    `mimo.plugins.data`).

    With it the loop runs the encoders once per step for all micro-batches (`--encoder-pass step`): one launch of
    every encoder kernel instead of one per micro-batch. Optional: without it (or None) they run per micro-batch.
    """


@hookspec(firstresult=True)
def loss(settings, output_tensor, loss_mask):
    """Return `(loss_sum, num_tokens)` for one micro-batch from the language model's per-token output.

    mimo's default sums the per-token loss over `loss_mask`; the loop divides by the global token count.
    """


@hookspec(firstresult=True)
def frozen_parameters(settings):
    """Return name prefixes of parameters that do not train (a training stage), as named in megatron-core's
    MimoModel: `language_model.`, `modality_submodules.<modality>.encoders.`, `...input_projections.`.

    A module with nothing left to train gets no optimizer. mimo's default freezes nothing.
    """


@hookspec(firstresult=True)
def lora_targets(settings):
    """Return the layers that get LoRA adapters when a run asks for them (`--lora-rank R`) without naming any
    (`--lora-targets`): `{module: [name, ...]}`, module `mimo.LANGUAGE`, a modality (its encoders) or
    "projection" (every modality's input projections); a name is a layer's attribute name as megatron-core names
    its linears (`linear_qkv`, `linear_proj`, `linear_fc1`, `in_proj`, ...), "experts" (a MoE layer's routed
    experts), "shared_experts" or "all". The loop builds, shards, trains, saves and merges the adapters.
    Optional: without it a LoRA run needs --lora-targets.
    """


@hookspec(firstresult=True)
def model_flops(settings):
    """Return `{module name: forward FLOPs per sample}` (matmul FLOPs, 2 per multiply-add; MoE counts the
    experts a token is routed to, not all of them). The loop takes training as 3x forward for TFLOP/s and MFU.
    Optional: without it those figures are left out of the logs.
    """


@hookspec(firstresult=True)
def sample_flops(settings, tokens, image_patches):
    """Return `{module name: forward FLOPs}` of ONE sample as `model_flops` counts them: `tokens` LLM tokens (its
    length, image placeholders included; attention within the sample alone, as packed samples attend) and images
    whose encoder sequences have `image_patches` patches each (a list, one entry per sequence: an image, or a tile
    of one). A `--data` run sums it over the samples it trains, from each one's real length and images, for its
    TFLOP/s and MFU (`model_flops` at the synthetic shape gives the same figure). The loop asks for a sample's parts
    apart, its tokens (no images) and each image (no tokens), and adds them: as MimoModel runs a sample, each image
    through its encoder alone and the LLM over the tokens, placeholders included. Optional: without it those figures
    count `model_flops` per row of seq_length, padding included.
    """


@hookspec(firstresult=True)
def module_memory(settings):
    """Return `{module name: mimo.plugins.ModuleMemory}` for every module of model_shape: each layer's parameters
    by how they split over the ranks and the activation bytes it keeps per token by recompute mode
    (`mimo.plugins.kit.memory_layers` has formulas for megatron-core's layer kinds). `mimo plan` and `mimo run` turn
    it into a per-rank estimate for the layout and refuse one that does not fit the GPU's memory. Optional:
    without it nothing is estimated.
    """


@hookspec(firstresult=True)
def kernel_configs(settings):
    """Return a `mimo.plugins.KernelConfigs`: the Python modules whose Triton autotuned kernels a GPU run pins and
    records (`modules`, e.g. "mamba_ssm.ops.triton.ssd_bmm"; one not installed is skipped) and Triton autotune
    tables for them (`tables`: JSON objects as mimo records them in its compile cache's `kernel_configs.json`: gpu,
    capability, triton and, per kernel `module.attribute`, key and config), whose choices the run pins before its
    first iteration instead of autotuning. A table applies to its GPU model and compute capability, a choice only
    where the installed kernel still offers that config. A plain list of tables (the hook's first form) tunes the
    modules its kernels are named after. Optional: without it mimo pins and records nothing, and kernels autotune at
    first use.
    """


@hookspec(firstresult=True)
def hf_settings(hf_config, part):
    """Return this provider's settings (a dict of setting names to values) that a Hugging Face config.json
    (`hf_config`, a dict) determines for `part`: "model" (a whole model folder: `--pretrained HF_DIR`, `mimo ckpt
    import-hf HF_DIR`), "language" (`--pretrained-llm DIR`: the LLM alone) or "vision" (`--pretrained-vision DIR`:
    the vision encoder alone). None for a model type the provider does not read as that part. A config it reads
    but cannot express raises `mimo.errors.UsageError`, one line naming the field and its value. Optional.
    """


@hookspec(firstresult=True)
def hf_tensor_map(settings, hf_config, part):
    """Return a `mimo.plugins.kit.tensor_map.TensorMap` for `part` of a Hugging Face checkpoint: for every
    dist-checkpoint key of the modules the part covers (the keys a mimo checkpoint saves: `language_model.`,
    `modality_submodules.<modality>.encoders.<encoder>.`, `...input_projections.0.`, without DDP's `module.`),
    where its global tensor is among the checkpoint's tensors (`Src`, `Cat`, `Stack`). The same on every rank: each
    rank reads only the slices its layout holds. None for a model type the provider does not read as that part.
    Optional (with hf_settings).
    """


@hookspec(firstresult=True)
def hf_export_check(settings):
    """Return `{setting: (this value, the value export needs)}` for every setting a Hugging Face export of the model
    cannot express (`{}`: exportable), or None when the provider exports no Hugging Face models. `mimo run` (with
    --save) and `mimo plan` say so at start; `mimo ckpt export-hf` refuses with all of them. Optional.
    """


@hookspec(firstresult=True)
def hf_export(settings):
    """Return a `mimo.plugins.kit.tensor_map.HFExport` for settings hf_export_check accepts: config.json, the
    TensorMap of the whole model (its keys all saved in the checkpoint; `derived` for tensors rebuilt rather than
    read), other files of the folder (tokenizer, processor) and notes. `mimo ckpt export-hf` streams the tensors
    from the checkpoint through the map into shards. Its `loaded_modules` (optional) names, for each linear's
    weight, the modules of the model transformers loads from the folder (`LoadedModule`: after transformers'
    load-time renaming and splitting): `export-hf --adapter-only` writes a LoRA run's adapters onto them as a PEFT
    adapter. Optional.
    """


@hookspec(firstresult=True)
def load_pretrained(settings, model, directory):
    """Load the weights of a checkpoint in a format of the provider's own (`--pretrained DIR` that is neither a mimo
    checkpoint nor a Hugging Face folder; `directory` is the megatron-core dist-checkpoint directory itself) into
    `model`, the built MimoModel holding this rank's modules in any layout. Collective over the world. Return
    True when it read the checkpoint, None when the format is not its own. A weight the model needs that the
    checkpoint lacks, or a weight of the checkpoint the model has no place for, raises `mimo.errors.UsageError`
    (one line). Optional.
    """


@hookspec(firstresult=True)
def prompt_format(settings):
    """Return a `mimo.PromptFormat` (tokenizer, chat template, image mode, where the encoder input goes) for
    `mimo generate` and `--eval-samples`. mimo decodes the language model with megatron-core's static inference
    context (GPTModel and HybridModel do; a layer of the provider's own keeps its decoding state in
    `inference_context.key_value_memory_dict` under megatron-core's InferenceMode, docs/provider-guide.md).
    Raise `mimo.errors.UsageError` (one line) when these settings cannot generate. Optional: without it the
    provider cannot generate.
    """
