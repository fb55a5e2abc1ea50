"""scripts/gpu/hf_train_parity.py on the CPU (tiny size, local backend): a random transformers omni VLM imported
and trained one iteration with `mimo run --pretrained`; mimo's loss equals transformers' on that global batch.
The same script runs the mid size with the te backend on a GPU (docs/verification.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import REPO


def test_the_first_training_loss_from_hugging_face_weights_is_transformers_loss(tmp_path):
    record = tmp_path / "record.json"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu" / "hf_train_parity.py"), "--size", "tiny",
                             "--backend", "local", "--device", "cpu", "--json", str(record)],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env={**os.environ, "TORCH_COMPILE_DISABLE": "1", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    figures = json.loads(record.read_text())
    assert figures["images"] > 0 and figures["loss_tokens"] > 0
    assert figures["relative_error"] <= 1e-4, figures
