"""docs/lora.md's example runs as written: a base saved, adapters trained on it and resumed, merged, and the adapter
checkpoint (over its base) and the merged one evaluate to the same loss on the same samples."""

from __future__ import annotations

import shlex

from helpers import REPO, doc_example_lines, run_mimo

DOC = REPO / "docs" / "lora.md"
DOC_ROOT = "/tmp/mimo-lora"  # where the example writes; the test writes under its own folder instead


def test_the_documented_example_runs_and_merged_evaluates_as_base_plus_adapters(tmp_path):
    lines = doc_example_lines(DOC)
    assert [shlex.split(line)[1] for line in lines] == ["run", "run", "run", "ckpt", "eval", "eval"]
    evaluations = []
    for line in lines:
        result = run_mimo(*shlex.split(line.replace(DOC_ROOT, str(tmp_path)))[1:])
        assert result.returncode == 0, (line, result.stderr[-3000:])
        evaluations += [out for out in result.stdout.splitlines() if out.startswith("validation")]
    assert (tmp_path / "adapters" / "iter_0000004").is_dir() and (tmp_path / "merged" / "iter_0000000").is_dir()
    adapters, merged = (e.split("|")[1:-1] for e in evaluations)  # what follows the iteration, before the time
    assert adapters == merged  # loss, perplexity, samples and tokens
