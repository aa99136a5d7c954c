"""Weight sources: a training module's weights, as servers load them.

``ModuleSource`` is the one to use; ``gathering`` holds one gatherer per
sharding scheme and ``checkpoint_format`` the transformers conversions.
"""

from wt_callbacks.transfer.sources.module import ModuleSource

__all__ = ["ModuleSource"]
