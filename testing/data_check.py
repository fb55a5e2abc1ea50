"""`data_provider`: micro-batches in the schema the loop and MimoModel read, the same samples for every layout.

The per-image token count needs the built encoder (its output length); `train_check` checks it on the model.
"""

from __future__ import annotations

import itertools

import torch

from mimo.plugins import DataContext, Encoder

from .data_source_check import check_capabilities, check_data_source
from .model_check import encoder_arguments
from .report import ContractError
from .subject import Subject

TEXT_KEYS = ("input_ids", "labels", "loss_mask", "position_ids")
INTEGER_KEYS = ("input_ids", "labels", "position_ids")
SEED = 1234


def read(subject: Subject, count: int, **ctx_fields) -> list[dict]:
    """The first `count` micro-batches of `data_provider` for a DataContext with `ctx_fields` (small defaults),
    its DataSource checked before and after reading, then closed."""
    fields = dict(micro_batch_size=2, num_microbatches=2, num_lanes=1, seed=SEED) | ctx_fields
    source = check_data_source(subject.call("data_provider", settings=subject.settings, ctx=DataContext(**fields)),
                               subject.name)
    try:
        batches = list(itertools.islice(source, count))
        check_capabilities(source)
    except ContractError:
        raise
    except Exception as err:  # noqa: BLE001 - raised by the provider's iterator
        raise ContractError("data_provider", f"its iterator raised {type(err).__name__}: {err}") from err
    finally:
        source.close()
    if len(batches) < count:
        raise ContractError("data_provider", f"stopped after {len(batches)} micro-batches; the loop reads as many "
                                             f"as it trains (yield forever, or as long as the data lasts)")
    return batches


def check_data(subject: Subject, encoders: dict[str, Encoder], vocab_size: int | None = None) -> int:
    """Schema, token ranges and placeholders of the first micro-batches, and layout independence. Returns the
    sequence length."""
    batches = read(subject, 4)
    seq_length = None
    for m, batch in enumerate(batches):
        seq_length = check_micro_batch(batch, 2, encoders, vocab_size, f"micro-batch {m}", seq_length)
    if sum(float(b["loss_mask"].sum()) for b in batches) == 0:
        raise ContractError("data_provider", "no token of the first 4 micro-batches counts in the loss "
                                             "(loss_mask is all 0): nothing would train")
    again = read(subject, 4)
    if not all(_same(a, b) for a, b in zip(batches, again)):
        raise ContractError("data_provider", "two readers with the same DataContext got different micro-batches: "
                                             "a sample must depend only on ctx.seed and its index")
    check_layout_independence(subject)
    return seq_length


def check_micro_batch(batch, rows: int, encoders: dict[str, Encoder], vocab_size: int | None, where: str,
                      seq_length: int | None = None) -> int:
    """One micro-batch of `rows` samples against the schema in mimo.plugins.hookspecs.data_provider."""
    if not isinstance(batch, dict):
        raise ContractError("data_provider", f"{where} must be a dict, got {type(batch).__name__}")
    missing = [k for k in TEXT_KEYS + ("modality_inputs",) if k not in batch]
    if missing:
        raise ContractError("data_provider", f"{where} lacks {missing} (has {sorted(batch)})")
    for key in TEXT_KEYS:
        value = batch[key]
        # position_ids may carry position axes in front: [A, micro_batch_size, seq] (multimodal RoPE's 3)
        dims = (2, 3) if key == "position_ids" else (2,)
        if not isinstance(value, torch.Tensor) or value.dim() not in dims:
            shape = "[micro_batch_size, seq] tensor" + (" (or [axes, micro_batch_size, seq])" if len(dims) > 1 else "")
            raise ContractError("data_provider", f"{where}: {key} must be a {shape}, got {_shape(value)}")
        if value.shape[-2] != rows:
            raise ContractError("data_provider", f"{where}: {key} has {value.shape[-2]} rows but the DataContext "
                                                 f"asked for {rows} samples (one per index of ctx.sample_indices())")
        seq_length = seq_length or value.shape[-1]
        if value.shape[-1] != seq_length:
            raise ContractError("data_provider", f"{where}: {key} is {tuple(value.shape)}, other tensors have "
                                                 f"sequence length {seq_length}")
        if key in INTEGER_KEYS and value.is_floating_point():
            raise ContractError("data_provider", f"{where}: {key} must hold integers, got {value.dtype}")
    mask = batch["loss_mask"]
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ContractError("data_provider", f"{where}: loss_mask must hold only 0 and 1")
    for key in ("input_ids", "labels"):
        ids = batch[key]
        if int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size):
            raise ContractError("data_provider", f"{where}: {key} holds ids in [{int(ids.min())}, {int(ids.max())}]"
                                                 f", outside the language model's vocabulary [0, {vocab_size})")
    _check_modality_inputs(batch, encoders, where)
    return seq_length


def _check_modality_inputs(batch, encoders: dict[str, Encoder], where: str) -> None:
    inputs = batch["modality_inputs"]
    if not isinstance(inputs, dict):
        raise ContractError("data_provider", f"{where}: modality_inputs must be a dict, got {type(inputs).__name__}")
    unknown = sorted(set(inputs) - set(encoders))
    if unknown:
        raise ContractError("data_provider", f"{where}: modality_inputs has modalities {unknown} that "
                                             f"build_encoders does not return (it returns {sorted(encoders)})")
    for modality, encoder in encoders.items():
        placeholders = int((batch["input_ids"] == encoder.placeholder_token_id).sum())
        given = inputs.get(modality)
        if placeholders and not given:
            raise ContractError("data_provider", f"{where} has {placeholders} '{modality}' placeholder tokens "
                                                 f"(id {encoder.placeholder_token_id}) but no "
                                                 f"modality_inputs['{modality}']")
        if given and not placeholders:
            raise ContractError("data_provider", f"{where} has modality_inputs['{modality}'] but no placeholder "
                                                 f"token (id {encoder.placeholder_token_id}) in input_ids; leave "
                                                 f"the modality out of a micro-batch without images")
        if given:
            _check_encoder_inputs(given, encoder, modality, where)


def _check_encoder_inputs(given, encoder: Encoder, modality: str, where: str) -> None:
    path = f"modality_inputs['{modality}']"
    if not isinstance(given, dict) or not all(isinstance(v, dict) for v in given.values()):
        raise ContractError("data_provider", f"{where}: {path} must be {{encoder name: {{argument: tensor}}}}")
    declared = encoder_arguments(encoder)
    if declared:
        if sorted(given) != sorted(declared):
            raise ContractError("data_provider", f"{where}: {path} has inputs for encoders {sorted(given)} but the "
                                                 f"'{modality}' spec of build_encoders has encoders {sorted(declared)}")
        for name, arguments in given.items():
            accepted = declared[name]
            extra = sorted(set(arguments) - accepted) if accepted is not None else []
            if extra:
                raise ContractError("data_provider", f"{where}: {path}['{name}'] passes {extra}, which the encoder's "
                                                     f"forward does not take (it takes {sorted(accepted)})")


def check_layout_independence(subject: Subject) -> None:
    """Two LLM lanes read one by one equal one reader of both lanes' positions (an encoder rank feeding both):
    the global batch does not depend on the layout."""
    lanes = dict(micro_batch_size=2, num_microbatches=2, num_lanes=2)
    lane0 = read(subject, 2, **lanes, first_position=0)
    lane1 = read(subject, 2, **lanes, first_position=2)
    both = read(subject, 2, **lanes, first_position=0, num_positions=4)
    for m in range(2):
        joined = torch.cat([lane0[m]["input_ids"], lane1[m]["input_ids"]])
        if both[m]["input_ids"].shape != joined.shape or not torch.equal(both[m]["input_ids"], joined):
            raise ContractError("data_provider", f"micro-batch {m}: reading lanes 0 and 1 together (num_positions=4) "
                                                 f"differs from reading each lane; build each micro-batch from the "
                                                 f"indices ctx.sample_indices() yields, one sample per index")


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in TEXT_KEYS)


def _shape(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
