"""Moved to `mimo.plugins.kit.dist_checkpoint` (the kit of what providers may reuse: docs/provider-guide.md). This old path
is the same module, for providers written against it; new code imports the kit's."""

import sys

from .kit import dist_checkpoint as _moved

sys.modules[__name__] = _moved  # `import mimo.plugins.dist_checkpoint` gives the kit's module itself
