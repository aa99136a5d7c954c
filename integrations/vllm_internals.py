"""Which vLLM internals the plugin's parts lean on are gone from the installed vLLM.

Each part that reaches into vLLM's private modules lists what it uses; a vLLM
upgrade that moves one must fail where the part starts (and in the tests),
not leave a round stale or slow.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any


def missing_names(required: Mapping[str, Iterable[str]]) -> list[str]:
    """``module.name`` for each name (dotted: ``Class.method``) a module lacks,
    or ``module`` where it does not import; ``[]`` when all are there."""
    missing = []
    for module_name, names in required.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        for name in names:
            target: Any = module
            for part in name.split("."):
                target = getattr(target, part, None)
            if target is None:
                missing.append(f"{module_name}.{name}")
    return missing
