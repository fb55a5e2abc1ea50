"""Moved to `mimo.plugins.kit.memory_layers` (the kit of what providers may reuse: docs/provider-guide.md). This old path
is the same module, for providers written against it; new code imports the kit's."""

import sys

from .kit import memory_layers as _moved

sys.modules[__name__] = _moved  # `import mimo.plugins.memory_layers` gives the kit's module itself
