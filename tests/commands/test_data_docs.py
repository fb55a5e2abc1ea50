"""docs/data.md's examples run as written: each writes its dataset with webdataset's ShardWriter, prepares it with
energon's own `energon prepare` command, and both built-in providers read it through the real loader with the
settings of its `mimo run` line."""

from __future__ import annotations

import math
import re
import shlex

import pytest

from helpers import REPO, read_metrics, run_mimo
from mimo.plugins import DataContext, Registry
from mimo.plugins.settings import build_settings

DOC = REPO / "docs" / "data.md"
DOC_ROOT = "/tmp/mimo-data"  # where the examples write; each test writes under its own folder instead


def examples() -> tuple[str, dict[str, tuple[str, list[str]]]]:
    """(the helper's code, {example name: (its Python code, its command lines)}), in the order of the doc."""
    text = DOC.read_text().split("### Examples", 1)[1].split("\n## ", 1)[0]
    helper = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    found = {}
    for section in re.split(r"^#### ", text, flags=re.M)[1:]:
        name = section.splitlines()[0].strip()
        code = "".join(re.findall(r"```python\n(.*?)```", section, re.S))
        commands = [line for block in re.findall(r"```bash\n(.*?)```", section, re.S)
                    for line in block.splitlines() if line.strip()]
        found[name] = (code, commands)
    return helper, found


HELPER, EXAMPLES = examples()


def test_the_doc_has_an_example_for_every_format_in_its_table():
    section = DOC.read_text().split("## Accepted formats", 1)[1].split("### Examples", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # below the header
    linked = [(re.findall(r"\]\(#([^)]+)\)", row) or [row])[-1] for row in rows]
    assert linked and all(name.replace("-", " ") in EXAMPLES for name in linked), (linked, list(EXAMPLES))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Every example run in the doc's order (the blend uses the datasets before it): {name: its commands}."""
    from megatron.energon.tools.prepare import command as energon_prepare

    root = tmp_path_factory.mktemp("mimo-data")
    namespace: dict = {}
    exec(HELPER, namespace)  # noqa: S102 - the doc's own code, checked to run as written
    runs = {}
    for name, (code, commands) in EXAMPLES.items():
        exec(code.replace(DOC_ROOT, str(root)), namespace)  # noqa: S102
        runs[name] = [shlex.split(line.replace(DOC_ROOT, str(root))) for line in commands]
        for argv in runs[name]:
            if argv[:2] == ["energon", "prepare"]:
                energon_prepare.main(argv[2:], standalone_mode=False)
    return runs


def run_options(argv: list[str]) -> tuple[str, str, list[str]]:
    """(provider, --data, --set values) of a `mimo run` line."""
    assert argv[:2] == ["mimo", "run"], argv
    options = {}
    sets = []
    for flag, value in zip(argv[2::2], argv[3::2]):
        if flag == "--set":
            sets.append(value)
        else:
            options[flag] = value
    return options["--provider"], options["--data"], sets


@pytest.mark.parametrize("name", list(EXAMPLES))
@pytest.mark.parametrize("provider", ["nemotron-moe-vlm-tiny", "mock-vlm"])
def test_each_example_dataset_reads_through_the_real_loader(written, name, provider):
    runs = [argv for argv in written[name] if argv[:2] == ["mimo", "run"]]
    assert len(runs) == 1, written[name]
    documented, data, sets = run_options(runs[0])
    assert documented == "nemotron-moe-vlm-tiny"
    registry = Registry()
    entry, _ = registry.get(provider)
    # the line's sequence length (the documented provider's), which mock-vlm takes too
    seq_length = build_settings(registry.get(documented)[0], sets).seq_length
    settings = build_settings(entry, [*sets, f"seq_length={seq_length}"])
    ctx = DataContext(micro_batch_size=2, num_microbatches=1, num_lanes=1, seed=1, data_path=data)
    loader = registry.hooks(provider).data_provider(settings=settings, ctx=ctx)
    try:
        batches = [next(loader) for _ in range(3)]
    finally:
        loader.close()
    assert all(b["input_ids"].shape == (2, settings.seq_length) for b in batches)
    assert all(float(b["loss_mask"].sum()) > 0 for b in batches)
    assert loader.skipped_samples == 0
    if name != "text":
        assert any(b["modality_inputs"] for b in batches)


def test_each_documented_mimo_run_line_trains(written, tmp_path):
    """The `mimo run` lines as written (3 iterations instead of the doc's 20, to keep the suite short)."""
    for name, commands in written.items():
        argv = next(argv for argv in commands if argv[:2] == ["mimo", "run"])
        argv = [("3" if previous == "--train-iters" else arg) for previous, arg in zip([None, *argv], argv)]
        metrics = tmp_path / f"{name}.jsonl"
        result = run_mimo(*argv[1:], "--log-interval", "1", "--metrics-file", str(metrics),
                          env={"TORCH_COMPILE_DISABLE": "1"})
        assert result.returncode == 0, (name, result.stderr[-3000:])
        losses = [r["lm_loss"] for r in read_metrics(metrics)]
        assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), (name, losses)


# the formats `mimo data inspect` names for each example's samples
FORMATS = {"captions": "captions", "vqa": "vqa", "multiple choice": "multiple choice", "interleaved": "interleaved",
           "sequence": "sequence", "text": "text", "chat": "chat", "blend": "captions"}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_inspect_and_preview_read_each_example(written, name):
    """`mimo data inspect` and `preview` on each example's dataset (the blend's too), with the provider and settings
    of its `mimo run` line and without a provider: every sample read, none skipped, within 80 columns."""
    from typer.testing import CliRunner

    from mimo.cli.data import data_app

    provider, data, sets = run_options(next(argv for argv in written[name] if argv[:2] == ["mimo", "run"]))
    given = ["--provider", provider] + [arg for value in sets for arg in ("--set", value)]
    for command, options in [("inspect", []), ("inspect", given), ("preview", given), ("preview", [])]:
        result = CliRunner().invoke(data_app, [command, data, *options])
        assert result.exit_code == 0, (command, options, result.output)
        lines = result.stdout.splitlines()
        assert all(len(line) <= 80 for line in lines), result.stdout
        if command == "inspect":
            assert "skipped: none" in lines and re.search(r"^read: (\d+) of the \1 train samples \(all", result.stdout,
                                                          re.M), result.stdout
            assert re.search(rf"^formats: .*\b{FORMATS[name]} \d+", result.stdout, re.M), result.stdout
            assert ("total tokens / sample" in result.stdout) == bool(options)
        else:
            assert "sample 1 (" in result.stdout and ("[[" in result.stdout) == bool(options), result.stdout
