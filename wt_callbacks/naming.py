"""Checkpoint names for the parameters of a wrapped training module.

Training wraps models (DDP, ``torch.compile``, FSDP1, activation
checkpointing, Lightning's forward wrapper) and every wrapper inserts an
attribute segment into ``named_parameters()``. Servers load *checkpoint*
names, so the sent names drop those segments:

* ``module`` as the leading segment only (DDP / DataParallel): deeper down a
  submodule may legitimately be called ``module``.
* ``_orig_mod`` (``torch.compile``, also mid-name for regional compilation),
  ``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module`` and
  ``_forward_module`` anywhere: no model names its own attributes so.
"""

from __future__ import annotations

import difflib

import torch

WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module"})
"""Segments wrappers insert at any depth."""
LEADING_WRAPPER_SEGMENT = "module"
"""Segment DDP inserts at the root."""


def checkpoint_name(name: str) -> str:
    """``name`` without wrapper segments (``"module._orig_mod.lm_head.weight"`` -> ``"lm_head.weight"``)."""
    parts = [p for p in name.split(".") if p not in WRAPPER_SEGMENTS]
    if parts[:1] == [LEADING_WRAPPER_SEGMENT]:
        parts = parts[1:]
    return ".".join(parts)


def find_submodule(module: torch.nn.Module, path: str | None) -> torch.nn.Module:
    """The submodule at ``path``, a dotted path in checkpoint naming.

    Resolving through checkpoint names lets ``module: model`` reach
    ``pl_module.model`` whether or not DDP or ``torch.compile`` sits in between.
    """
    if not path:
        return module
    found: dict[str, torch.nn.Module] = {}
    for name, sub in module.named_modules():
        found.setdefault(checkpoint_name(name), sub)
    if path in found:
        return found[path]
    hint = difflib.get_close_matches(path, [n for n in found if n], n=1)
    children = [checkpoint_name(n) for n, _ in module.named_children()]
    raise ValueError(
        f"module={path!r}: {type(module).__name__} has no submodule {path!r}"
        + (f"; did you mean {hint[0]!r}?" if hint else f"; its top-level submodules are {children}")
    )
