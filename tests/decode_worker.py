"""Run by tests/multiprocess/test_generation.py in a process of its own (a world of one on the CPU): for a provider and
settings, mimo's incremental decoding against recomputing the whole sequence at every step, on prompts with and
without an image. Prints one JSON line per prompt. On a GPU (the te backend's kernels):

    MIMO_DECODE_DEVICE=cuda MIMO_DECODE_STEPS=graph python tests/decode_worker.py nemotron-moe-vlm-tiny backend=te \
        seq_length=256
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main(provider: str, assignments: list[str], new_tokens: int = 24) -> None:
    from mimo.core.config import RunConfig, TrainingOptions
    from mimo.core.generation import decoder as decoder_module
    from mimo.core.generation.decoder import Decoder
    from mimo.core.generation.sampling import Sampler, SamplingOptions
    from mimo.core.run.plan import prepare
    from mimo.core.run.world import join
    from mimo.data.conversation import IMAGE, Turn
    from mimo.data.prompts import Prompt, encode
    from mimo.testing.generation_check import recompute_greedy

    config = RunConfig(provider=provider, provider_settings=assignments,
                       training=TrainingOptions(micro_batch_size=1, train_iters=1,
                                                device=os.environ.get("MIMO_DECODE_DEVICE", "cpu")))
    plan = prepare(config, world_size=1)
    world = join(plan, seed=0)
    model = world.build_model()
    fmt = plan.hooks.prompt_format(settings=plan.settings)
    image = torch.rand(3, 48, 80, generator=torch.Generator().manual_seed(0))
    long_text = "Describe every detail of the picture, slowly and carefully, in many words. " * 2
    prompts = {"image": Prompt([Turn("user", (IMAGE, "What is in the picture?"))], [image]),
               "text": Prompt([Turn("user", ("Hello there.",))]),
               # two images: the encoder sees both at once, and the prompt is encoded again at every recomputation
               "long": Prompt([Turn("user", (IMAGE, long_text, IMAGE))], [image, image.flip(-1)[:, :32]])}
    # caches of 64 positions: the first prompts share one (48 + 24 and 31 + 24 fit 128), the long one takes a longer
    decoder_module.CACHE_ROOM = 64
    decoder = Decoder(model, device=world.device, params_dtype=world.params_dtype)
    # megatron-core's own layers and a stop check at every step: what the other ways of stepping must equal
    plain = Decoder(model, device=world.device, params_dtype=world.params_dtype, steps="waiting")
    # one-token attention with the position on the device (what a CUDA graph captures), eagerly on a CPU; on a GPU
    # (MIMO_DECODE_STEPS=graph) captured and replayed
    on_device = Decoder(model, device=world.device, params_dtype=world.params_dtype,
                        steps=os.environ.get("MIMO_DECODE_STEPS", "device"))

    def answer(d, encoded, stop_ids=frozenset()):
        g = d.generate(encoded, max_new_tokens=new_tokens, stop_ids=stop_ids,
                       sampler=Sampler(SamplingOptions(), world.device))
        return {"tokens": g.tokens, "stop": g.stop}

    with decoder.one_token_moe().active() as sync_free_moe_layers:
        pass
    for name, prompt in prompts.items():
        encoded = encode(prompt, fmt)
        got = answer(decoder, encoded)["tokens"]
        want, _ = recompute_greedy(decoder, encoded, new_tokens)
        stop = frozenset({got[10]})  # a stop token inside the answer, between two host checks
        print(json.dumps({"prompt": name, "prompt_tokens": encoded.num_tokens, "cached": got,
                          "recomputed": want, "image_token": fmt.tokenizer.image_token_id,
                          "plain": answer(plain, encoded)["tokens"], "stopped": answer(decoder, encoded, stop),
                          "plain_stopped": answer(plain, encoded, stop),
                          "device": answer(on_device, encoded)["tokens"],
                          "device_stopped": answer(on_device, encoded, stop), "steps": on_device.steps,
                          "default_steps": decoder.steps,
                          "one_token_attention_layers": len(on_device.one_token_attention().layers),
                          "cache_positions": on_device._context.max_sequence_length,
                          "sync_free_moe_layers": sync_free_moe_layers}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
