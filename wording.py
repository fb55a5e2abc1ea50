"""How mimo's lines word a count: `1 image`, `2 images`. At the bottom of the imports (every room may use it, as
mimo.errors), so a message never says "1 images"."""

from __future__ import annotations


def plural(noun: str) -> str:
    """English plural of a noun mimo counts: `micro-batch` -> `micro-batches`, `image slot` -> `image slots`."""
    return noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


def counted(n: int, noun: str, many: str | None = None, thousands: bool = False) -> str:
    """`n noun` with the noun's plural where n is not 1 (`many` where English adds no s); `thousands`: 1,000."""
    number = f"{n:,}" if thousands else str(n)
    return f"{number} {noun if n == 1 else many or plural(noun)}"
