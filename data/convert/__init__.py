"""Converting datasets from other formats into energon datasets mimo reads (`mimo data convert ...`)."""

from .llava import convert_llava

__all__ = ["convert_llava"]
