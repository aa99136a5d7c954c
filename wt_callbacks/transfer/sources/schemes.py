"""Which sharding scheme holds a module's parameters, detected, never configured.

``sharding_scheme`` looks at the module as the framework holds it (the
FSDP1 root, the DeepSpeed engine, DDP) and answers one scheme, or raises for
a module whose parameters cannot be sent from rank 0 alone: one that mixes
schemes, a DeepSpeed pipeline stage, DeepSpeed tensor-parallel (AutoTP)
layers; ``gather_for`` picks the gatherer for the answer (one module per
gatherer, their base class in ``gathering``).
"""

from __future__ import annotations

import sys

import torch

from wt_callbacks.naming import find_submodule
from wt_callbacks.transfer.sources.fsdp1 import FSDP1Units
from wt_callbacks.transfer.sources.fsdp2 import FSDP2Shards
from wt_callbacks.transfer.sources.gathering import LocalParameters, ParameterGather
from wt_callbacks.transfer.sources.zero3 import Zero3Groups

FSDP1 = "FSDP1 (FullyShardedDataParallel)"
ZERO3 = "DeepSpeed ZeRO-3"
DTENSOR = "DTensor (FSDP2 fully_shard / tensor parallel)"


def sharding_scheme(module: torch.nn.Module, root: torch.nn.Module) -> str | None:
    """``FSDP1``, ``ZERO3`` or ``DTENSOR`` for how the parameters of ``root``
    (``module`` or a submodule of it) are held; ``None`` for whole tensors
    (single device, DDP, DeepSpeed ZeRO-1/2).

    FSDP1 is looked for in all of ``module``: its root unit wraps the
    selected submodule from outside and owns some of its parameters.

    Raises:
        ValueError: a module mixing schemes, or one that leaves each rank a
            part of the model, naming what to use instead.
    """
    _refuse_partial_models(module)
    found = _schemes(module, root)
    if len(found) > 1:
        seen = " and ".join(f"{scheme} ({where})" for scheme, where in found.items())
        raise ValueError(
            f"the module mixes sharding schemes: {seen}. Shard it with one scheme, or send a part "
            "that uses one (module: ...)"
        )
    return next(iter(found), None)


def _schemes(module: torch.nn.Module, root: torch.nn.Module) -> dict[str, str]:
    """The sharding schemes found, each with where it was first seen."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    found: dict[str, str] = {}
    for name, sub in module.named_modules():
        if isinstance(sub, FullyShardedDataParallel):
            found.setdefault(FSDP1, f"unit {name!r}" if name else "the root unit")
        elif isinstance(sub, FSDPModule):
            # Not only its DTensor parameters: after a forward without a
            # backward it may hold them unsharded, as plain tensors.
            found.setdefault(DTENSOR, f"fully_shard module {name!r}" if name else "the fully_shard root")
    for name, param in root.named_parameters():
        # Set on FSDP1's flat parameters and, under use_orig_params, on the originals.
        if getattr(param, "_fsdp_flattened", False):
            found.setdefault(FSDP1, f"parameter {name!r}")
        elif hasattr(param, "ds_id"):
            found.setdefault(ZERO3, f"parameter {name!r}")
        elif isinstance(param, DTensor):
            found.setdefault(DTENSOR, f"parameter {name!r}")
    return found


def _refuse_partial_models(module: torch.nn.Module) -> None:
    """Pipeline stages and DeepSpeed's tensor-parallel layers leave each rank
    a part of the model: rank 0 would send its part as if it were all."""
    # Only a process that built such a model has imported these modules.
    pipe = sys.modules.get("deepspeed.runtime.pipe.module")
    layers = sys.modules.get("deepspeed.module_inject.layers")
    # TensorParallel_Layer, the base of every AutoTP layer, is younger than the two others.
    tensor_parallel = tuple(
        getattr(layers, name) for name in ("TensorParallel_Layer", "LinearAllreduce", "LinearLayer") if hasattr(layers, name)
    )
    for name, sub in module.named_modules():
        where = repr(name) if name else "the module"
        if pipe is not None and isinstance(sub, pipe.PipelineModule):
            raise ValueError(
                f"{where} is a DeepSpeed PipelineModule: each rank holds only its pipeline "
                "stage, so rank 0 cannot send the model. Sync from a data-parallel engine (ZeRO stage 0-3 "
                "without pipeline parallelism)"
            )
        if isinstance(sub, tensor_parallel):
            raise ValueError(
                f"{where} is a DeepSpeed tensor-parallel layer ({type(sub).__name__}, AutoTP): each rank holds "
                "a slice of it, so rank 0 cannot send the model. Sync from a data-parallel engine "
                "(tensor_parallel autotp_size 1), or use FSDP2 with DTensor tensor parallelism"
            )


def gather_for(module: torch.nn.Module, submodule: str | None = None) -> ParameterGather:
    """The gatherer for how ``module``'s parameters are held, reporting those
    of its ``submodule`` (a path in checkpoint naming; ``None``: all).

    ``module`` is the module as the framework holds it (the FSDP1 root, the
    DeepSpeed engine, DDP): an FSDP1 root unit lives there, outside the
    submodule it wraps.

    Raises:
        ValueError: for a module mixing schemes, or a scheme whose
            parameters cannot be sent, naming the strategy and what to use
            instead.
    """
    root = find_submodule(module, submodule)
    scheme = sharding_scheme(module, root)
    if scheme == FSDP1:
        return FSDP1Units(module, submodule)
    if scheme == ZERO3:
        return Zero3Groups(root)
    if scheme == DTENSOR:
        return FSDP2Shards(root, sharded_root=module)
    return LocalParameters(root)
