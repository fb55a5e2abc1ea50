"""Scoring generated answers against references as reading-comprehension benchmarks do (SQuAD's normalisation):
lowercase, punctuation and the English articles removed, whitespace collapsed. Exact match: the normalised texts
are equal; token F1: the harmonic mean of precision and recall of the normalised words, counted as a bag."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(answer: str, reference: str) -> float:
    return float(normalize(answer) == normalize(reference))


def token_f1(answer: str, reference: str) -> float:
    said, wanted = normalize(answer).split(), normalize(reference).split()
    if not said or not wanted:
        return float(said == wanted)  # both empty: a match; one empty: none
    common = sum((Counter(said) & Counter(wanted)).values())
    if not common:
        return 0.0
    precision, recall = common / len(said), common / len(wanted)
    return 2 * precision * recall / (precision + recall)


def mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None
