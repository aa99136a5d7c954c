"""wt_callbacks: keep vLLM servers serving the weights your trainer produces.

The core (this package) imports torch and requests only. Framework adapters
live in ``wt_callbacks.integrations``.
"""

__version__ = "0.1.0"

_LAZY = {
    "WeightSyncCallback": "wt_callbacks.integrations.lightning",
    "WeightSyncHook": "wt_callbacks.integrations.accelerate",
    "WeightSyncTrainerCallback": "wt_callbacks.integrations.transformers",
}


def __getattr__(name: str):
    # Lazy, so `import wt_callbacks` never imports a training framework.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'wt_callbacks' has no attribute {name!r}")
