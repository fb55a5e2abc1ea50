"""The generation half of the contract: a provider's `prompt_format` renders a prompt with an image, and mimo's
incremental decoding (megatron-core's inference context, the encoder once) gives the same greedy tokens as a
plain recomputation of the whole sequence at every step, the check that a provider's own layers keep their decoding
state right. Also what mimo's tests compare against (`recompute_greedy`)."""

from __future__ import annotations

import torch

from .report import ContractError

CHECK_TOKENS = 8


@torch.no_grad()
def recompute_greedy(decoder, prompt, max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """The reference: the encoders, the merge and the whole language model over the prompt and the tokens so far,
    every step, without a cache. Returns (tokens, each step's last-position logits). A generated token is text
    (an image placeholder the model emits is embedded as a token), as in incremental decoding."""
    from mimo.core.generation.decoder import eval_mode
    from mimo.core.forward.batch_transfer import to_device

    input_ids = prompt.input_ids.to(decoder.device)
    length = input_ids.shape[1]
    prompt_positions, shift = decoder.prompt_positions(prompt)  # the answer's positions go on from the prompt's
    modality_inputs = to_device(prompt.modality_inputs, decoder.device, decoder.params_dtype)
    embedding = decoder.lm.embedding
    tokens, logits_seen = [], []
    with eval_mode(decoder.model):
        for _ in range(max_new_tokens):
            combined = decoder.prompt_embeddings(input_ids, modality_inputs)
            positions = prompt_positions
            if tokens:
                new = torch.tensor([tokens], device=decoder.device)
                after = torch.arange(length, length + len(tokens), device=decoder.device)[None] + shift
                combined = torch.cat([combined, embedding(input_ids=new, position_ids=after)], 0)
                after = after.expand(*positions.shape[:-2], 1, -1) if positions.dim() == 3 else after
                positions = torch.cat([positions, after], dim=-1)
            logits = decoder.lm(input_ids=None, position_ids=positions, decoder_input=combined, attention_mask=None,
                                runtime_gather_output=True)
            last = logits[0, -1].float()
            logits_seen.append(last)
            tokens.append(int(last.argmax()))
    return tokens, logits_seen


def check_generation(hooks, settings, world, model) -> str | None:
    """ContractError when cached decoding and recomputation disagree; a note when the provider cannot generate."""
    from mimo.core.generation.decoder import Decoder
    from mimo.core.generation.sampling import Sampler, SamplingOptions
    from mimo.data.conversation import IMAGE, Turn
    from mimo.data.prompts import Prompt, encode
    from mimo.plugins import PromptFormat

    fmt = hooks.prompt_format(settings=settings)
    if fmt is None:
        return "generation not checked: no prompt_format hook (the provider cannot generate)"
    if not isinstance(fmt, PromptFormat):
        raise ContractError("prompt_format", f"must return a mimo.PromptFormat, got {type(fmt).__name__}")
    image = fmt.image_mode is not None
    prompt = Prompt([Turn("user", ((IMAGE,) if image else ()) + ("What is in the picture?",))],
                    [torch.rand(3, 48, 80, generator=torch.Generator().manual_seed(0))] if image else [])
    encoded = encode(prompt, fmt)
    if not fmt.template.stop_ids(fmt.tokenizer):
        raise ContractError("prompt_format", "the chat template ends no answer (no stop ids)")
    decoder = Decoder(model, device=world.device, params_dtype=world.params_dtype)
    sampler = Sampler(SamplingOptions(), world.device)
    got = decoder.generate(encoded, max_new_tokens=CHECK_TOKENS, stop_ids=frozenset(), sampler=sampler).tokens
    want, _ = recompute_greedy(decoder, encoded, CHECK_TOKENS)
    if got != want:
        raise ContractError("prompt_format", f"decoding with megatron-core's inference context gives tokens {got}, "
                                             f"recomputing the whole sequence {want}: a layer keeps its decoding "
                                             f"state wrong (docs/provider-guide.md#generation)")
    return None
