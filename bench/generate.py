"""(h) Decoding speed: `mimo generate`'s decoder against transformers' `generate`, same weights, same prompt.

    python bench/generate.py --out results/generate       # one GPU with transformer-engine, mamba-ssm, transformers
    python bench/generate.py --out /tmp/smoke --quick     # the script itself, tiny, on a CPU (figures mean nothing)

nemotron-moe-vlm-mid (RADIO 660M + the 20-layer Mamba/MoE/attention LLM), in the Hugging Face omni model's form
(`OMNI_FORM`: an MLP projection), is built by mimo with random weights in bf16 (`backend=te`: megatron-core's
MambaMixer with its Triton kernels, transformer-engine layers), saved and exported (`mimo ckpt export-hf`'s code) into a
Hugging Face folder, and loaded by transformers' `NemotronH_Omni_Reasoning_V3`
(which uses mamba-ssm's and causal-conv1d's kernels when installed: the record says which ran). Both answer the
same prompt (one 768 x 1024 image and a question, rendered by mimo's prompt format: the same token ids and image
patches), greedy, forced to `--new-tokens` tokens (256; no stop token).

`--family qwen`: the same for Qwen3.5-VL (`FAMILIES`: the 35B-A3B at every width, 8 layers, 64 experts; transformers'
`AutoModelForImageTextToText` of its export, fed mimo's token ids, pixels and image grids). With `--compare-logits`
the first engine's teacher-forced logits are also compared with transformers' on the same tokens (one forward over
the prompt and the answer): the bf16 parity of issue 62 at a mid size.

For each engine, after one warm-up (first-use compilation), `--repeats` times: a 1-token call (the prefill: the
encoder and the prompt, and the first token) and a full call; decode tokens/s = (new tokens - 1) / (full - 1-token
call), wall time with the GPU synchronized. Printed: min / median / max; written: `<out>/generate.json`.

`--compare-logits`: each mimo engine is also fed the first one's greedy answer (teacher forcing) and its logits
compared step by step with the first one's (greedy answers part at the first near tie; this shows whether two ways
of stepping compute the same).

`--profile DIR`: after the timings, torch.profiler over `--profile-steps` one-token steps of each engine (chrome
traces and a summary in DIR, bench/decode_profile.py): host vs GPU busy time per step, host syncs per step, the top
ops by self CPU and CUDA time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # megatron-core's fused functions eager, as transformers runs

from common import device_description  # noqa: E402
from decode_profile import profile_decode, report  # noqa: E402

QUESTION = "Describe everything in this picture in detail."
# What the Hugging Face omni model is (export refuses other forms): an MLP projection with its
# norm after pixel shuffle, dynamic resolution, RADIO with a video patch embedder. The LLM is the variant's.
OMNI_FORM = ["pixel_shuffle=true", "projection=mlp", "projection_norm=true", "dynamic_resolution=true",
             "video_temporal_patch_size=2"]


# --family: the provider and settings measured on a GPU and with --quick on a CPU, and transformers' side of it
FAMILIES = {
    # RADIO 660M + the 20-layer Mamba/MoE/attention LLM, in the omni model's form
    "nemotron": dict(provider="nemotron-moe-vlm-mid", settings=["backend=te", *OMNI_FORM],
                     quick_provider="nemotron-moe-vlm-tiny", quick_settings=["backend=local", *OMNI_FORM]),
    # Qwen3.5-VL 35B-A3B at every released width, 8 of its 40 layers (the 3:1 gated delta net / attention
    # pattern), 64 of its 256 experts (top 8): a mid size whose export transformers loads beside it on one GPU
    "qwen": dict(provider="qwen3.5-vl-35b-a3b",
                 settings=["backend=te", "layer_pattern=GGG*GGG*", "num_experts=64", "max_pixels=1048576"],
                 quick_provider="qwen3.5-vl-moe-tiny", quick_settings=["backend=local"]),
}


def transformers_side(family: str, folder: Path, prompt, plan, dtype, device):
    """transformers' model of the exported folder, its inputs for mimo's prompt (the same token ids and pixels),
    and where its kernels come from."""
    if family == "nemotron":
        from transformers.models.nemotron_h import modeling_nemotron_h
        from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

        hf = NemotronH_Omni_Reasoning_V3.from_pretrained(folder, dtype=dtype).to(device).eval()
        patches = prompt.modality_inputs["images"]["radio"]
        inputs = dict(input_ids=prompt.input_ids.to(device), pixel_values=patches["x"][0].to(device, dtype),
                      image_grid_hw=(patches["imgs_sizes"] // plan.settings.patch_size).to(device))
        kernels = {name: getattr(getattr(modeling_nemotron_h, name, None), "__module__", None) for name in (
            "causal_conv1d_fn", "causal_conv1d_update", "mamba2_selective_state_update", "mamba2_chunk_scan")}
        return hf, inputs, kernels
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype).to(device).eval()
    images = prompt.modality_inputs["images"]["visual"]
    ids = prompt.input_ids.to(device)
    image_token = json.loads((folder / "config.json").read_text())["image_token_id"]
    inputs = dict(input_ids=ids, pixel_values=images["pixel_values"].to(device, dtype),
                  image_grid_thw=images["grid_thw"].to(device), mm_token_type_ids=(ids == image_token).int())
    # transformers takes the gated delta rule from the Hugging Face kernels hub where it can (package `kernels`,
    # network), else its torch fallback
    delta_net = next((m for m in hf.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    kernels = {"gated_delta_net": type(delta_net).__module__ if delta_net is not None else None,
               "hub_kernels_installed": importlib.util.find_spec("kernels") is not None}
    return hf, inputs, kernels


def teacher_forced_logits(hf, inputs: dict, answer: list[int]) -> "torch.Tensor":
    """transformers' logits for each answer token, the prompt and the answer before it given (one forward)."""
    import torch

    ids = torch.cat([inputs["input_ids"], torch.tensor([answer[:-1]], device=inputs["input_ids"].device)], dim=1)
    forced = {**inputs, "input_ids": ids}
    if "mm_token_type_ids" in inputs:
        forced["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"],
                                                 torch.zeros(1, len(answer) - 1, dtype=torch.int32,
                                                             device=ids.device)], dim=1)
    with torch.no_grad():
        logits = hf(**forced).logits[0, inputs["input_ids"].shape[1] - 1:]
    return logits.float()


def build_mimo(provider: str, settings: list[str], precision: str, device: str):
    from mimo.core.config import RunConfig, TrainingOptions
    from mimo.core.run.plan import prepare
    from mimo.core.run.world import join

    config = RunConfig(provider=provider, provider_settings=settings, training=TrainingOptions(
        micro_batch_size=1, train_iters=1, precision=precision, device=device))
    world = join(prepare(config, world_size=1), seed=0)
    return world, world.build_model()


def export(world, model, folder: Path) -> None:
    """The model's weights as a Hugging Face folder, as `mimo ckpt export-hf` writes it from a checkpoint."""
    from mimo.core.checkpoint.checkpointer import Checkpointer
    from mimo.core.checkpoint.hf_export import export_hf
    from mimo.core.checkpoint.layout import run_info
    from mimo.core.config import CheckpointOptions

    plan, checkpoint = world.plan, folder.parent / "checkpoint"
    saver = Checkpointer(CheckpointOptions(save=checkpoint, save_optim=False, save_rng=False), model=model,
                         topology=world.topology, run_info=run_info(plan, plan.settings, lane_data_state=False))
    saver.report_saves = False
    saver.save(0, 0)
    export_hf(checkpoint, folder)


def timed(call, device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, result


def measure(name: str, generate, new_tokens: int, repeats: int, device) -> dict:
    """Warm up, then `repeats` x (1-token call, full call)."""
    warm, tokens = timed(lambda: generate(new_tokens), device)
    print(f"{name}: warm-up {warm:.1f} s (first-use compilation included)", flush=True)
    prefill, decode = [], []
    for _ in range(repeats):
        first, _ = timed(lambda: generate(1), device)
        full, tokens = timed(lambda: generate(new_tokens), device)
        assert len(tokens) == new_tokens, (name, len(tokens))
        prefill.append(first)
        decode.append((new_tokens - 1) / (full - first))
    return {"engine": name, "prefill_seconds": _spread(prefill), "decode_tokens_per_second": _spread(decode),
            "warmup_seconds": warm, "tokens": tokens}


class Forced:
    """A sampler that feeds the given tokens whatever the logits, and keeps each step's logits."""

    def __init__(self, tokens: list[int], device):
        import torch

        self.tokens, self.logits = torch.tensor(tokens, device=device), []

    def choose(self, logits):
        self.logits.append(logits.float().clone())
        return self.tokens[len(self.logits) - 1].view(1, 1)


def compare_logits(decoder, prompt, first: dict, reference: list) -> dict:
    """Every step's logits with the first engine's greedy answer fed in (teacher forcing), against the first
    engine's: the largest difference (and the logits' spread, for scale) and how often the top token agrees. The
    greedy answers of two engines part at the first near tie; this says whether the steps compute the same."""
    import torch

    forced = Forced(first["tokens"], decoder.device)
    decoder.generate(prompt, max_new_tokens=len(first["tokens"]), stop_ids=frozenset(), sampler=forced)
    if not reference:
        reference.extend(forced.logits)
    diffs = torch.stack([(a - b).abs().max() for a, b in zip(forced.logits, reference)])
    same_top = sum(int(a.argmax() == b.argmax()) for a, b in zip(forced.logits, reference))
    return {"max_abs_diff": float(diffs.max()), "median_step_max_abs_diff": float(diffs.median()),
            "logits_std": float(torch.stack(reference).std()), "same_top_token": same_top,
            "steps": len(reference)}


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "all": values}


def main(argv=None) -> int:
    from mimo.core.generation.decoder import STEPS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="nemotron")
    parser.add_argument("--quick", action="store_true", help="the family's tiny provider, backend local, CPU, fp32")
    parser.add_argument("--profile", type=Path, help="also profile a few decode steps of each engine into DIR")
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument("--steps", nargs="+", default=["auto"], choices=STEPS,
                        help="mimo's ways of stepping to measure, in this order (docs/generation.md): auto (graph "
                             "on a GPU), graph, device, sync-free, waiting")
    parser.add_argument("--compare-logits", action="store_true",
                        help="also feed every mimo engine the first one's answer and compare their logits")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    import torch

    family = FAMILIES[args.family]
    if args.quick:
        provider, settings, precision, device_name, image_size = (family["quick_provider"], family["quick_settings"],
                                                                  "fp32", "cpu", (48, 80))
        args.new_tokens = min(args.new_tokens, 16)
    else:
        if not torch.cuda.is_available():
            print("error: bench/generate.py needs a GPU (or --quick)", file=sys.stderr)
            return 2
        provider, settings, precision, device_name, image_size = (family["provider"], family["settings"], "bf16",
                                                                  "cuda", (768, 1024))
    world, model = build_mimo(provider, settings, precision, device_name)
    device, dtype = world.device, world.params_dtype
    plan = world.plan
    from mimo.core.generation.decoder import Decoder
    from mimo.core.generation.sampling import Sampler, SamplingOptions
    from mimo.data.prompts import encode, from_text

    image_path = args.out / "picture.png"
    args.out.mkdir(parents=True, exist_ok=True)
    from PIL import Image

    pixels = torch.rand(*image_size, 3, generator=torch.Generator().manual_seed(0)) * 255
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(image_path)
    fmt = plan.hooks.prompt_format(settings=plan.settings)
    prompt = encode(from_text(QUESTION, [image_path]), fmt)
    scratch = Path(tempfile.mkdtemp(prefix="mimo-bench-generate-", dir=args.out))
    try:
        export(world, model, scratch / "hf")
        sampler = Sampler(SamplingOptions(), device)
        engines, profiles, reference, parity = [], {}, [], None
        for steps in args.steps:  # each way of stepping with its own decoder, one after the other
            decoder = Decoder(model, device=device, params_dtype=dtype, steps=steps)
            mimo_generate = lambda n: decoder.generate(prompt, max_new_tokens=n,  # noqa: E731
                                                       stop_ids=frozenset(), sampler=sampler).tokens
            name = f"mimo {decoder.steps}"
            engines.append({**measure(name, mimo_generate, args.new_tokens, args.repeats, device),
                            "steps": decoder.steps})
            if args.compare_logits:
                engines[-1]["logits"] = compare_logits(decoder, prompt, engines[0], reference)
            if args.profile and decoder.steps != "graph":  # a graph replays no module: nothing to mark
                profiles[name] = profile_decode(name.replace(" ", "-"), mimo_generate, decoder.lm,
                                                args.profile_steps, device, args.profile)
            del decoder
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

        hf, inputs, kernels = transformers_side(args.family, scratch / "hf", prompt, plan, dtype, device)

        def hf_generate(n: int) -> list[int]:
            with torch.no_grad():
                out = hf.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                  pad_token_id=fmt.tokenizer.pad_id)
            return out[0, prompt.num_tokens:].tolist()

        transformers = measure("transformers", hf_generate, args.new_tokens, args.repeats, device)
        if args.profile:
            profiles["transformers"] = profile_decode("transformers", hf_generate, hf, args.profile_steps, device,
                                                      args.profile)
        if reference:  # the first mimo engine's logits fed its own greedy answer, against transformers' (bf16 parity)
            theirs = teacher_forced_logits(hf, inputs, engines[0]["tokens"])
            ours = torch.stack(reference).reshape(theirs.shape).to(theirs.device)
            parity = {"max_abs_diff": float((ours - theirs).abs().max()), "logits_std": float(theirs.std()),
                      "relative_error": float((ours - theirs).norm() / theirs.norm()),
                      "same_top_token": int((ours.argmax(-1) == theirs.argmax(-1)).sum()), "steps": len(reference)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    mimo = engines[0]

    def agree(a: list[int], b: list[int]) -> int:  # how many leading tokens two greedy answers share
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    for e in [*engines, transformers]:
        e["agrees_with_first_for"] = agree(e["tokens"], mimo["tokens"])
    record = {"benchmark": "generate", "device": device_description(), "provider": provider, "settings": settings,
              "precision": precision, "steps": [e["steps"] for e in engines], "prompt_tokens": prompt.num_tokens,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "engines": [*engines, transformers],
              "transformers_kernels": kernels, "teacher_forced_against_transformers": parity,
              "seconds": time.perf_counter() - started, "command": " ".join([sys.executable, *sys.argv])}
    for engine in record["engines"]:
        engine.pop("tokens")
    path = args.out / "generate.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"{provider} {precision} on {record['device'].get('gpu') or 'cpu'}: prompt {prompt.num_tokens} tokens, "
          f"{args.new_tokens} new tokens, {args.repeats} repeats (min / median / max)")
    for e in record["engines"]:
        p, d = e["prefill_seconds"], e["decode_tokens_per_second"]
        print(f"  {e['engine']:<16} prefill {p['min']:.3f} / {p['median']:.3f} / {p['max']:.3f} s | decode "
              f"{d['min']:.1f} / {d['median']:.1f} / {d['max']:.1f} tokens/s")
    print(f"  greedy tokens shared with {mimo['engine']}: " + ", ".join(
        f"{e['engine']} {e['agrees_with_first_for']} of {args.new_tokens}" for e in record["engines"][1:])
        + f"; transformers' kernels: {kernels}")
    if parity:
        print(f"  teacher-forced logits, {mimo['engine']} against transformers on {parity['steps']} answer tokens: "
              f"relative error {parity['relative_error']:.3g}, at most {parity['max_abs_diff']:.3g} apart (logits' "
              f"std {parity['logits_std']:.3g}), same top token at {parity['same_top_token']}")
    for e in engines[1:] if args.compare_logits else ():
        c = e["logits"]
        print(f"  {e['engine']} against {mimo['engine']}, fed the same tokens: logits differ by at most "
              f"{c['max_abs_diff']:.3g} (median step {c['median_step_max_abs_diff']:.3g}; logits' std "
              f"{c['logits_std']:.3g}), same top token at {c['same_top_token']} of {c['steps']} steps")
    for name, summary in profiles.items():
        print(report(name, summary))
    if profiles:
        (args.profile / "summary.json").write_text(json.dumps(profiles, indent=1))
    print(f"results: {path} ({record['seconds']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
