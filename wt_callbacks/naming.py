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
import logging
from collections.abc import Iterator, Sequence
from fnmatch import fnmatchcase

import torch

logger = logging.getLogger(__name__)

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


class CheckpointParameters:
    """``named_parameters()`` of a (wrapped) module under checkpoint names.

    Given to ``ModuleSource`` in place of the module: ``ModuleSource`` reads
    nothing but ``named_parameters()``, so its cast-before-gather, its
    ``metadata()`` and ``with_wire_dtype`` apply to these names unchanged, and
    metadata and iteration agree because both come from here. Names are
    recomputed on every call, so parameters replaced after setup (FSDP2's
    ``fully_shard``, a strategy moving the model) are the ones sent.

    Args:
        module: the module as the training framework holds it.
        submodule: ``find_submodule`` path of the part to send (``None``: all).
        include: ``fnmatch`` patterns; a name is sent if it matches one (empty: all).
        exclude: ``fnmatch`` patterns; a name matching one is not sent.

    Raises:
        ValueError: at construction, if two parameters map to one name or the
            patterns leave nothing to send; the message names the key to fix.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        submodule: str | None = None,
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
    ) -> None:
        self.module = module
        self.submodule = submodule
        self.include = tuple(include)
        self.exclude = tuple(exclude)
        names = [name for name, _ in self._all_parameters()]
        for key, patterns in (("include", self.include), ("exclude", self.exclude)):
            for pattern in patterns:
                if not any(fnmatchcase(n, pattern) for n in names):
                    logger.warning("%s pattern %r matches none of the %d parameter names", key, pattern, len(names))
        if not any(self._selected(n) for n in names):
            raise ValueError(
                f"nothing to send: module={submodule!r} include={list(self.include)} "
                f"exclude={list(self.exclude)} select none of the {len(names)} parameters "
                f"(names look like {names[:4]}); fix include / exclude / module"
            )

    def _selected(self, name: str) -> bool:
        if self.include and not any(fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatchcase(name, p) for p in self.exclude)

    def _all_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        origin: dict[str, str] = {}
        params = []
        for raw, param in find_submodule(self.module, self.submodule).named_parameters():
            name = checkpoint_name(raw)
            if name in origin:
                raise ValueError(
                    f"parameters {origin[name]!r} and {raw!r} both become {name!r} once wrapper "
                    "prefixes are stripped; send only one of them with module= or exclude="
                )
            origin[name] = raw
            params.append((name, param))
        return params

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Selected parameters as ``(checkpoint name, parameter)``, in module order."""
        return iter([(name, p) for name, p in self._all_parameters() if self._selected(name)])
