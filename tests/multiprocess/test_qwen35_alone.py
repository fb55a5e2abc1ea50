"""The Qwen3.5 family installed alone, as a third party's package would be: a fresh virtual environment gets mimo's
source less providers/qwen35 (its package and entry point taken out of pyproject.toml) and, beside it, a
distribution `mimo-qwen35` of the package copied as the top-level `mimo_qwen35`, registered through its own
`mimo.providers` entry point. (The environment reuses the installed dependencies, torch and megatron-core, through
a .pth line: there is no network to install them from.) There, qwen3.5-vl-tiny passes the contract kit, trains,
resumes bit for bit, exports a Hugging Face folder, and transformers loads the export with the logits mimo
computes from it (fp32, within 1e-4)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

from helpers import REPO

PROVIDER = "qwen3.5-vl-tiny"
FAMILY = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"
[project]
name = "mimo-qwen35"
version = "0.1.0"
dependencies = ["mimo"]
[project.entry-points."mimo.providers"]
qwen35 = "mimo_qwen35"
[tool.setuptools]
packages = ["mimo_qwen35", "mimo_qwen35.hf"]
"""
# run in the environment, one interpreter for what needs no process of its own (each start imports torch and
# megatron-core): where mimo and the family come from, `mimo providers list --json`, the contract kit; a JSON line
INSTALLED = """
import importlib.util, json, sys, mimo, mimo_qwen35
from typer.testing import CliRunner
from mimo.cli.main import app
from mimo.testing import check_provider

listing = CliRunner().invoke(app, ["providers", "list", "--json"])
assert listing.exit_code == 0, listing.output
summary = check_provider(sys.argv[1]).summary()
print(json.dumps({"alone": importlib.util.find_spec("mimo.providers.qwen35") is None, "mimo": mimo.__file__,
                  "family": mimo_qwen35.__file__, "listing": json.loads(listing.stdout), "contract": summary}))
"""
# run in the environment: `mimo ckpt export-hf SAVE EXPORT`, then transformers' logits of the export against
# mimo's, the export read as --pretrained
LOGITS = """
import sys, torch, transformers
from typer.testing import CliRunner
sys.path.insert(0, sys.argv[3])
from helpers import world_of_one
from mimo.cli.main import app
from mimo.core.checkpoint.hf_load import hf_loader
from mimo.core.config import CheckpointOptions, RunConfig, TrainingOptions
from mimo.core.run.plan import prepare
from mimo.core.run.world import join
from mimo_qwen35.positions import mrope_positions

exported = CliRunner().invoke(app, ["ckpt", "export-hf", sys.argv[1], sys.argv[2]])
assert exported.exit_code == 0, exported.output
folder = sys.argv[2]
with world_of_one():
    config = RunConfig(provider="qwen3.5-vl-tiny", provider_settings=["backend=local"],
                       training=TrainingOptions(device="cpu", micro_batch_size=1),
                       checkpoint=CheckpointOptions(pretrained=folder))
    plan = prepare(config, world_size=1)
    model = join(plan).build_model().eval()
    hf_loader(plan, model)()
    s, gen = plan.settings, torch.Generator().manual_seed(0)
    image_id = s.image_token_id if s.image_token_id is not None else s.vocab_size - 1
    images = [s.image_mode().process(torch.rand(3, h, w, generator=gen)) for h, w in ((40, 56), (32, 32))]
    ids = torch.randint(0, 256, (3,), generator=gen).tolist()
    for image in images:
        ids += [image_id] * image.num_tokens + torch.randint(0, 256, (4,), generator=gen).tolist()
    ids = torch.tensor([ids])
    grids = torch.tensor([im.grid_thw for im in images])
    m = s.spatial_merge_size
    positions = mrope_positions(ids[0], image_id, [(t, h // m, w // m) for t, h, w in grids.tolist()])[:, None]
    pixels = s.image_mode().collate(images)["pixel_values"]
    with torch.no_grad():
        got, _ = model(input_ids=ids, position_ids=positions, attention_mask=None, labels=None,
                       loss_mask=torch.ones(ids.shape),
                       modality_inputs={"images": {"visual": {"pixel_values": pixels, "grid_thw": grids}}})
        reference = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(folder).eval()
        want = reference(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                         mm_token_type_ids=(ids == image_id).int()).logits
print(float((got - want).abs().max() / want.abs().max()))
"""


def _mimo_less_the_family(root: Path) -> Path:
    """A copy of mimo's source without providers/qwen35, its packages and its entry point."""
    anywhere = shutil.ignore_patterns("__pycache__", "*.egg-info")

    def ignore(folder, names):  # the repository's own tests, benchmarks and build folders; not the scaffold's tests
        top = {".git", "build", ".venv", "tests", "bench"} if Path(folder) == REPO else set()
        return set(anywhere(folder, names)) | (top & set(names))

    source = root / "mimo-src"
    shutil.copytree(REPO, source, ignore=ignore)
    shutil.rmtree(source / "providers" / "qwen35")
    pyproject = (source / "pyproject.toml").read_text()
    lines = ('qwen35 = "mimo.providers.qwen35"\n', '"mimo.providers.qwen35", "mimo.providers.qwen35.hf",')
    for line in lines:
        assert line in pyproject, f"pyproject.toml no longer has {line.strip()}: update this test"
        pyproject = pyproject.replace(line, "")
    (source / "pyproject.toml").write_text(pyproject)
    return source


def _family(root: Path) -> Path:
    family = root / "mimo-qwen35"
    shutil.copytree(REPO / "providers" / "qwen35", family / "mimo_qwen35",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (family / "pyproject.toml").write_text(FAMILY)
    return family


def _environment(root: Path) -> Path:
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                              "--no-build-isolation", str(_mimo_less_the_family(root)), str(_family(root))],
                             capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    return python


def test_the_family_installed_alone_passes_the_contract_trains_resumes_and_exports(tmp_path):
    python = _environment(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1")
    cwd = tempfile.gettempdir()  # no repository folder first on sys.path

    def run(*args: str) -> subprocess.CompletedProcess:
        result = subprocess.run([str(python), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=900)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        return result

    def mimo(*args: str) -> subprocess.CompletedProcess:
        return run("-m", "mimo.cli", *args)

    found = json.loads(run("-c", textwrap.dedent(INSTALLED), PROVIDER).stdout.splitlines()[-1])
    assert found["alone"] and str(tmp_path / "venv") in found["mimo"] and str(tmp_path / "venv") in found["family"]
    listing = found["listing"]
    row = next(r for r in listing["providers"] if r["name"] == PROVIDER)
    assert row["distribution"] == "mimo-qwen35 0.1.0" and not listing["broken"], row
    assert PROVIDER in found["contract"]

    def train(name: str, *args: str) -> dict:
        metrics = tmp_path / f"{name}.jsonl"
        mimo("run", "--provider", PROVIDER, "--device", "cpu", "--seed", "3", "--train-iters", "4",
             "--log-interval", "1", "--metrics-file", str(metrics), *args)
        return {r["iteration"]: r["lm_loss"] for r in map(json.loads, metrics.read_text().splitlines())
                if "lm_loss" in r}

    save = tmp_path / "save"
    whole = train("whole", "--save", str(save), "--save-interval", "2")
    from2 = tmp_path / "from2"
    shutil.copytree(save / "iter_0000002", from2 / "iter_0000002")
    (from2 / "latest_checkpointed_iteration.txt").write_text("2\n")
    resumed = train("resumed", "--load", str(from2))
    assert resumed == {i: loss for i, loss in whole.items() if i > 2}  # exactly
    assert whole[4] < whole[1]

    error = float(run("-c", textwrap.dedent(LOGITS), str(save), str(tmp_path / "export"),
                      str(REPO / "tests")).stdout.split()[-1])
    assert error <= 1e-4, error
