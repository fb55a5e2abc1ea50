"""MimoModel's merge of text and encoder embeddings without a device-to-host synchronization.

megatron-core's MimoModel (`get_text_embeddings`, `align_embeddings_by_token_positions`) finds the text tokens with
`nonzero()` and checks each modality's placeholder count with `.item()`: three waits for the GPU in every
micro-batch's forward, each of which drains the GPU's queue while the host prepares the next kernels. The loop
knows the placeholders' positions before the batch leaves the host, so it hands them over (`placeholder_rows`),
and the merge becomes: embed every position (placeholders as token 0), then copy each encoder's embeddings into
its rows. The values are megatron-core's exactly, and so are the gradients: a replaced row passes no gradient to
the embedding of token 0, and the encoder's rows get the gradient of theirs (tests/unit/test_embedding_merge.py).
"""

from __future__ import annotations

import torch


def placeholder_rows(input_ids: torch.Tensor, special_token_ids: dict[str, int], device: torch.device,
                     ) -> dict[str, torch.Tensor] | None:
    """{modality: rows of its placeholders in the LLM's flattened [s * b] layout}, in the order the encoder emits
    them (sample by sample, each in sequence order), computed from `input_ids` [b, s] on the host and sent to
    `device` without waiting. None when the ids are already on a GPU (finding them there would synchronize)."""
    if input_ids.device.type != "cpu" or input_ids.dim() != 2:
        return None
    rows = {}
    for modality, token_id in special_token_ids.items():
        b, s = (input_ids == token_id).nonzero(as_tuple=True)
        found = s * input_ids.shape[0] + b
        if device.type == "cuda":
            found = found.pin_memory()
        rows[modality] = found.to(device, non_blocking=True)
    return rows


def embed_every_position(embedding, input_ids: torch.Tensor, position_ids, special_token_ids: dict[str, int]):
    """[s, b, h]: the language model's embedding of every position, placeholders looked up as token 0."""
    placeholder = torch.zeros_like(input_ids, dtype=torch.bool)
    for token_id in special_token_ids.values():
        placeholder |= input_ids == token_id
    if position_ids is not None and position_ids.dim() == 3:  # multimodal RoPE ids: the absolute channel
        position_ids = position_ids[0]
    return embedding(input_ids=input_ids.masked_fill(placeholder, 0), position_ids=position_ids)


def merge(dense: torch.Tensor, modality_embeddings: dict[str, torch.Tensor], rows: dict[str, torch.Tensor],
          ) -> torch.Tensor:
    """`dense` [s, b, h] with each modality's embeddings [n, h] copied into its `rows`; a modality with
    placeholders but no embeddings gets zeros there, as in megatron-core. Counts are checked on host shapes."""
    s, b, h = dense.shape
    flat = dense.reshape(s * b, h)
    for modality, where in rows.items():
        embeddings = modality_embeddings.get(modality)
        if embeddings is None:
            if where.numel():
                flat = flat.index_fill(0, where, 0.0)
            continue
        if where.numel() != embeddings.shape[0]:
            raise ValueError(f"Number of {modality} tokens ({where.numel()}) does not match number of {modality} "
                             f"embeddings ({embeddings.shape[0]})")
        flat = flat.index_copy(0, where, embeddings.to(flat.dtype))
    unknown = sorted(set(modality_embeddings) - set(rows) - {"text"})
    if unknown:
        raise ValueError(f"No special token ID defined for modality {unknown[0]}")
    return flat.view(s, b, h)
