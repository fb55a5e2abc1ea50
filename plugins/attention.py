"""Moved to `mimo.plugins.kit.attention` (the kit of what providers may reuse: docs/provider-guide.md). This old path
is the same module, for providers written against it; new code imports the kit's."""

import sys

from .kit import attention as _moved

sys.modules[__name__] = _moved  # `import mimo.plugins.attention` gives the kit's module itself
