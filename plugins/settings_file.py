"""The one reader of mimo's YAML and TOML settings files: a run file (`--config`, also each checkpoint's
`run.yaml`) and a provider's settings file (`--provider-config`, as `mimo ckpt import-hf` writes it).

Every caller goes through `read`, so a file that is missing, unreadable, malformed or not a mapping is the same
one line whichever option named it: the option and the file, the line where the parser stopped, and what to do.
What the mapping's names mean is the caller's to check (core/run_file.py, plugins/settings.py).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from mimo.errors import UsageError

# tomllib writes the place into its message ("Invalid value (at line 3, column 7)"); Python 3.12 has no attribute
_TOML_PLACE = re.compile(r"\s*\(at (?:line (\d+), column \d+|end of document)\)")


def read(path: Path, option: str, holds: str) -> dict:
    """The file's top-level mapping ({} for an empty file), YAML unless the name ends in .toml. `option` names the
    file on the command line (e.g. "--config"), `holds` what its mapping maps (e.g. "setting names to values")."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory: give the YAML or TOML file in it")
    if not path.is_file():
        raise UsageError(f"{option} {path}: no such file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{option} {path} cannot be read ({getattr(err, 'strerror', None) or err}): check the "
                         f"file's permissions and that it is UTF-8 text") from None
    kind = "TOML" if path.suffix == ".toml" else "YAML"
    try:
        data = tomllib.loads(text) if kind == "TOML" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as err:
        line, problem = _place(err)
        where = f" at line {line}" if line else ""
        raise UsageError(f"{option} {path} is not valid {kind}{where} ({problem}): correct the file there") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{option} {path} must hold a mapping of {holds}")
    return data


def _place(err: Exception) -> tuple[int | None, str]:
    """(line the parser stopped at, 1-based or None; its complaint in one line)."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        problem = err.problem or err.context or "cannot be parsed"
        return (mark.line + 1 if mark is not None else None), " ".join(problem.split())
    message = str(err).splitlines()[0] if str(err) else type(err).__name__
    found = _TOML_PLACE.search(message)
    line = int(found.group(1)) if found and found.group(1) else None
    return line, _TOML_PLACE.sub("", message)

