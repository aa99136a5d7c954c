"""Weight sources: a training module's weights, as servers load them.

``ModuleSource`` is the one to use. ``schemes`` detects how a module's
parameters are sharded and picks the gatherer for it (``gathering``: their
base class; ``fsdp1``, ``fsdp2``, ``zero3``: one per scheme);
``checkpoint_format`` holds the transformers conversions.
"""

from wt_callbacks.transfer.sources.module import ModuleSource

__all__ = ["ModuleSource"]
