"""A random Hugging Face omni VLM trained by `mimo run --pretrained`: mimo's iteration-1 loss against the loss
transformers' `NemotronH_Omni_Reasoning_V3` computes on the same global batch (fp32). Prints one JSON record.

    python scripts/gpu/hf_train_parity.py --size mid --backend te --device cuda     # a GPU with TE + mamba-ssm
    python scripts/gpu/hf_train_parity.py --size tiny --backend local --device cpu  # anywhere

The steps are a user's: save the model with `save_pretrained`, `mimo ckpt import-hf`, then one training
iteration at learning rate 0 with `--pretrained` and `--metrics-file`. The reference rebuilds that global batch
from the provider's synthetic data (sample i depends only on the seed and i, docs/providers.md), runs
transformers' model on it (images as the omni processor lays out patches: mimo's packed rows are that layout)
and takes the mean token cross-entropy over the loss mask, as mimo's loss does.

With the te backend the Mamba step size is not clamped (megatron-core's MambaMixer); the random step biases keep
every step above the reference's clamp, so both compute the same function. Run with NVIDIA_TF32_OVERRIDE=0:
TF32 GEMMs alone move the loss by about 1e-4 relative.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

TOLERANCE = 1e-4
SIZES = {
    # RADIO and the hybrid LLM; the LLM pattern holds every layer kind (Mamba, attention, MoE, dense MLP)
    "tiny": dict(radio=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2.0),
                 text=dict(vocab_size=264, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, n_routed_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
                           intermediate_size=64),
                 projector=64, seq_length=128, batch=(2, 4)),
    "mid": dict(radio=dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, mlp_ratio=4.0),
                text=dict(vocab_size=32768, hidden_size=1536, num_attention_heads=16, num_key_value_heads=2,
                          head_dim=96, mamba_num_heads=48, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
                          n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=768,
                          moe_shared_expert_intermediate_size=1536, intermediate_size=3072),
                projector=3072, seq_length=1024, batch=(2, 4)),
}
PATTERN = ["mamba", "attention", "moe", "mamba", "mlp", "mamba", "moe", "attention", "mamba", "moe"]


def save_reference(folder: Path, size: dict) -> None:
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    # max_img_size as C-RADIO's releases have it: its position grid holds every variant's max_patches
    radio = dict(model_type="radio", patch_size=16, max_img_size=2048, num_cls_tokens=1, num_registers=1,
                 video_temporal_patch_size=2, **size["radio"])
    text = dict(model_type="nemotron_h", layers_block_type=PATTERN, conv_kernel=4, **size["text"])
    config = NemotronH_Omni_Reasoning_V3_Config(vision_config=radio, text_config=text,
                                               vision_hidden_size=radio["hidden_size"],
                                               projector_hidden_size=size["projector"],
                                               image_token_id=size["text"]["vocab_size"] - 1)
    torch.manual_seed(0)
    model = NemotronH_Omni_Reasoning_V3(config).eval()
    with torch.no_grad():  # away from the initial values; step biases with softplus >= 0.018 > time_step_min
        for name, tensor in model.named_parameters():
            if "lambda1" in name:
                continue
            if name.endswith("dt_bias"):
                tensor.uniform_(-4.0, -2.0)
            elif name.endswith(("norm.weight", ".D")):
                tensor.uniform_(0.5, 1.5)
            else:
                tensor.normal_(0.0, 0.02)
    model.save_pretrained(folder)


def mimo(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "mimo.cli", *args], capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"mimo {' '.join(args)} failed:\n{result.stderr[-4000:]}")
    return result.stdout


def reference_loss(hf_dir: Path, provider: str, assignments: list[str], settings_file: Path, seed: int,
                   global_batch: int, device: str) -> tuple[float, int, int]:
    """transformers' loss on the run's global batch (sum of token losses over the loss mask / their count), the
    batch's images and its loss tokens."""
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    from mimo.plugins import Registry
    from mimo.plugins.settings import build_settings
    from mimo.providers.nemotron.data import SyntheticTask
    from mimo.providers.nemotron.settings import ENCODER, IMAGES

    settings = build_settings(Registry().get(provider)[0], assignments, settings_file)
    task = SyntheticTask(settings)
    batch = task.collate([task.sample(seed, i) for i in range(global_batch)])
    model = NemotronH_Omni_Reasoning_V3.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    kwargs, num_images = {}, 0
    if IMAGES in batch["modality_inputs"]:
        images = batch["modality_inputs"][IMAGES][ENCODER]
        kwargs = dict(pixel_values=images["x"][0].to(device),
                      image_grid_hw=(images["imgs_sizes"] // settings.patch_size).to(device))
        num_images = len(images["imgs_sizes"])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"].to(device), **kwargs).logits.float()
    losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].to(device).flatten(), reduction="none")
    mask = batch["loss_mask"].to(device).flatten()
    return float((losses * mask).sum() / mask.sum()), num_images, int(mask.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--backend", choices=["local", "te"], default="local")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the record to this file")
    args = parser.parse_args()
    size = SIZES[args.size]
    micro, global_batch = size["batch"]
    with tempfile.TemporaryDirectory(prefix="mimo-hf-parity-") as scratch:
        scratch = Path(scratch)
        hf_dir, imported, metrics = scratch / "hf", scratch / "imported", scratch / "metrics.jsonl"
        started = time.perf_counter()
        save_reference(hf_dir, size)
        out = mimo("ckpt", "import-hf", str(hf_dir), str(imported))
        provider = out.split("as provider ", 1)[1].split(":", 1)[0].strip()
        assignments = [f"seq_length={size['seq_length']}", f"backend={args.backend}"]
        if args.backend == "te":
            assignments.append("mamba_dt_clamp_min=0")
        settings_file = imported / "provider.yaml"
        mimo("run", "--provider", provider, "--provider-config", str(settings_file), "--pretrained", str(imported),
             *[a for s in assignments for a in ("--set", s)], "--train-iters", "1", "--lr", "0", "--precision",
             "fp32", "--device", args.device, "--seed", str(args.seed), "--micro-batch-size", str(micro),
             "--global-batch-size", str(global_batch), "--metrics-file", str(metrics))
        got = json.loads(metrics.read_text().splitlines()[0])["lm_loss"]
        want, num_images, num_tokens = reference_loss(hf_dir, provider, assignments, settings_file, args.seed, global_batch, args.device)
    record = dict(check="hf_train_parity", size=args.size, backend=args.backend, device=args.device,
                  gpu=torch.cuda.get_device_name() if args.device == "cuda" else None,
                  tf32_override=os.environ.get("NVIDIA_TF32_OVERRIDE"), provider=provider,
                  images=num_images, loss_tokens=num_tokens, mimo_loss=got, transformers_loss=want, relative_error=abs(got - want) / abs(want),
                  tolerance=TOLERANCE, seconds=round(time.perf_counter() - started, 1))
    record["passed"] = record["relative_error"] <= TOLERANCE
    print(json.dumps(record))
    if args.json:
        args.json.write_text(json.dumps(record) + "\n")
    sys.exit(0 if record["passed"] else 1)


if __name__ == "__main__":
    main()
