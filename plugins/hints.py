"""Closest-name hints for one-line errors: an unknown setting, provider or rule key names the one meant."""

from __future__ import annotations

import difflib


def suggest(word: str, choices) -> str:
    """'; did you mean X?' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""
