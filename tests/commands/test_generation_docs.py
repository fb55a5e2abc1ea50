"""docs/generation.md's example runs as written: a run that shows predictions at its evaluation and saves, then
`mimo generate` on its checkpoint answers a typed prompt (text, JSON) and a dataset's val questions."""

from __future__ import annotations

import json
import re
import shlex

from helpers import REPO, SAMPLE_ARGS, doc_example_lines, read_metrics, run_mimo

DOC = REPO / "docs" / "generation.md"
DOC_ROOT = "/tmp/mimo-generate"  # where the example writes; the test writes under its own folder instead


def test_the_documented_example_runs(tmp_path, sample_dataset):
    lines = doc_example_lines(DOC)
    assert [shlex.split(line)[:2] for line in lines] == [["mimo", "data"], ["mimo", "run"]] + [["mimo",
                                                                                              "generate"]] * 3
    results = []
    for line in lines:
        argv = shlex.split(line.replace(DOC_ROOT, str(tmp_path)))
        if argv[1:] == ["data", "sample", str(tmp_path / "ds"), *SAMPLE_ARGS]:
            sample_dataset(tmp_path / "ds")  # this very command, run once per test run (conftest.py)
            results.append(None)
            continue
        result = run_mimo(*argv[1:], env={"TORCH_COMPILE_DISABLE": "1"})
        assert result.returncode == 0, (line, result.stderr[-3000:])
        results.append(result)
    run, text, as_json, data = results[1:]
    assert "predictions (val) at iteration 6 | exact match" in run.stdout
    assert text.stdout.count("\n") == 1
    answer = json.loads(as_json.stdout)
    assert answer["answer"] == text.stdout[:-1] and 0 < answer["answer_tokens"] <= 24
    answers = read_metrics(tmp_path / "answers.jsonl")
    assert len(answers) == 4 and all(a["reference"] for a in answers)
    assert re.search(r"mimo generate: 4 answers to .* \(val\) \| exact match [\d.]+ \| token F1 [\d.]+", data.stderr)
