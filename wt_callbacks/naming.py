"""Checkpoint names for the parameters of a wrapped training module.

Training wraps models (DDP, ``torch.compile``, FSDP1, activation
checkpointing, Lightning's forward wrapper) and every wrapper inserts an
attribute segment into ``named_parameters()``. Servers load *checkpoint*
names, so the sent names drop those segments:

* data-parallel wrappers (DDP, DataParallel, a DeepSpeed engine) hold the
  model at ``.module``: names are taken inside them (``unwrap_data_parallel``),
  never by dropping a ``module`` segment, which may be the model's own
  attribute (``self.module = AutoModelForCausalLM...``).
* ``_orig_mod`` (``torch.compile``, also mid-name for regional compilation),
  ``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module`` and
  ``_forward_module`` anywhere: no model names its own attributes so.
"""

from __future__ import annotations

import difflib
import sys

import torch

WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module"})
"""Segments wrappers insert at any depth."""


def unwrap_data_parallel(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP, DataParallel or a DeepSpeed engine (each holds
    it at ``.module``), through ``torch.compile`` around them (``._orig_mod``);
    any other module as it is."""
    wrappers: tuple[type, ...] = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    # Only a process that built a DeepSpeed engine, or compiled, has imported these.
    engine = sys.modules.get("deepspeed.runtime.engine")
    if engine is not None:
        wrappers += (engine.DeepSpeedEngine,)
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    compiled: tuple[type, ...] = (dynamo.OptimizedModule,) if dynamo is not None else ()
    while isinstance(module, wrappers + compiled):
        module = module._orig_mod if isinstance(module, compiled) else module.module
    return module


def checkpoint_name(name: str) -> str:
    """``name`` without wrapper segments (``"_orig_mod.lm_head.weight"`` -> ``"lm_head.weight"``)."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_SEGMENTS)


def find_submodule(module: torch.nn.Module, path: str | None) -> torch.nn.Module:
    """The submodule at ``path``, a dotted path in checkpoint naming.

    Resolving inside data-parallel wrappers and through checkpoint names lets
    ``module: model`` reach ``pl_module.model`` whether or not DDP or
    ``torch.compile`` sits in between; without a path, the module itself
    (inside a data-parallel wrapper).
    """
    module = unwrap_data_parallel(module)
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
