"""One reader for run files, provider settings files and a checkpoint's run.yaml (plugins/settings_file.py): a
file that is missing, malformed or not a mapping is one line naming the option, the file and, for a malformed one,
the line the parser stopped at; the three callers word it the same."""

import pytest

from mimo.core import run_file
from mimo.errors import UsageError
from mimo.plugins import settings_file
from mimo.plugins.settings import build_settings
from test_settings import PROVIDER, Shape


@pytest.mark.parametrize("name, text, message", [
    ("bad.yaml", "a: 1\n  b: 2\n", "is not valid YAML at line 2 (mapping values are not allowed here): correct the "
                                   "file there"),
    ("bad.toml", "a = 1\nb = \n", "is not valid TOML at line 2 (Invalid value): correct the file there"),
    ("list.yaml", "- 1\n- 2\n", "must hold a mapping of setting names to values"),
])
def test_a_bad_file_is_one_line_naming_option_file_and_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UsageError) as caught:
        settings_file.read(path, "--provider-config", "setting names to values")
    assert str(caught.value) == f"--provider-config {path} {message}"


def test_an_empty_file_is_an_empty_mapping(tmp_path):
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    assert settings_file.read(tmp_path / "empty.yaml", "--config", "sections to values") == {}


def test_the_run_file_and_the_settings_file_readers_word_errors_alike(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\n  b: 2\n")
    with pytest.raises(UsageError) as as_run_file:
        run_file.read(bad)
    with pytest.raises(UsageError) as as_settings:
        build_settings(PROVIDER, [], bad)
    with pytest.raises(UsageError) as as_loop_check:
        run_file.refuse_loop_options(bad, Shape)
    problem = f"{bad} is not valid YAML at line 2 (mapping values are not allowed here): correct the file there"
    assert str(as_run_file.value) == f"--config {problem}"
    assert str(as_settings.value) == str(as_loop_check.value) == f"--provider-config {problem}"
    missing = tmp_path / "missing.toml"
    with pytest.raises(UsageError, match=f"^--config {missing}: no such file$"):
        run_file.read(missing)
    with pytest.raises(UsageError, match=f"^--provider-config {missing}: no such file$"):
        build_settings(PROVIDER, [], missing)
    with pytest.raises(UsageError, match=f"^--config {tmp_path} is a directory: give the YAML or TOML file in it$"):
        run_file.read(tmp_path)
