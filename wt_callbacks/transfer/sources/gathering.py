"""Full parameters out of a sharded module, one sharding scheme per gatherer.

A gatherer knows one way of holding parameters across trainer ranks and
turns them into full tensors. ``ModuleSource`` asks ``gather_for(module,
submodule)`` for the one that fits: the scheme is detected from the module,
never configured, so the same ``weight_sync`` section works under every
strategy. One module per scheme: ``LocalParameters`` here (whole tensors and
FSDP2 ``DTensor`` s), ``fsdp1`` (FSDP1 units), ``zero3`` (DeepSpeed ZeRO-3
groups).

Every gatherer keeps the ``WeightSource`` contract: ``parameters()``
reports full shapes without any communication, ``gather()`` is a
collective every rank runs with the same names in the same order, and the
cast to the wire dtype happens before the gather wherever the scheme
allows (half the bytes gathered for a bf16 wire).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

import torch

from wt_callbacks.naming import find_submodule
from wt_callbacks.transfer.base import ParamMeta, materialize_full_tensor


class ParameterGather(ABC):
    """How one sharding scheme turns a module's parameters into full tensors."""

    scheme: str
    """Name in messages and metrics, e.g. ``"fsdp2"``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    @abstractmethod
    def parameters(self) -> list[ParamMeta]:
        """Every parameter of the selected submodule, once (tied ones too),
        under its name relative to that submodule (wrapper segments may
        remain), its own dtype and full shape. No communication."""

    @abstractmethod
    def gather(self, names: Sequence[str], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors of ``names`` (a subset of ``parameters()``, in its
        order), floating-point ones in ``dtype`` (``None``: their own). A
        collective: every rank iterates it to the end with the same arguments.
        A yielded tensor stays valid and unchanged until the round ends."""


def wire_dtype(dtype: torch.dtype, wire: torch.dtype | None) -> torch.dtype:
    """What a tensor of ``dtype`` is sent as: floating point in ``wire`` (if given)."""
    return wire if wire is not None and dtype.is_floating_point else dtype


def to_wire(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` in its wire dtype (itself when that is its dtype)."""
    wire = wire_dtype(tensor.dtype, dtype)
    return tensor if wire == tensor.dtype else tensor.to(wire)


class LocalParameters(ParameterGather):
    """Parameters that are whole tensors on every rank (single device, DDP,
    DeepSpeed ZeRO-1/2) or FSDP2 ``DTensor``s (``fully_shard``), gathered
    one at a time through ``full_tensor()``, after the cast."""

    scheme = "local"

    def parameters(self) -> list[ParamMeta]:
        return [ParamMeta(name, p.dtype, tuple(p.shape)) for name, p in self.module.named_parameters()]

    def gather(self, names: Sequence[str], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        params = dict(self.module.named_parameters())
        for name in names:
            yield name, materialize_full_tensor(to_wire(params[name].detach(), dtype))


FSDP1 = "FSDP1 (FullyShardedDataParallel)"
ZERO3 = "DeepSpeed ZeRO-3"
DTENSOR = "DTensor (FSDP2 fully_shard / tensor parallel)"


def _schemes(module: torch.nn.Module, root: torch.nn.Module) -> dict[str, str]:
    """The sharding schemes found, each with where it was first seen.

    FSDP1 is looked for in all of ``module``: its root unit wraps the
    selected submodule from outside and owns some of its parameters.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    found: dict[str, str] = {}
    for name, sub in module.named_modules():
        if isinstance(sub, FullyShardedDataParallel):
            found.setdefault(FSDP1, f"unit {name!r}" if name else "the root unit")
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
    tensor_parallel = sys.modules.get("deepspeed.module_inject.layers")
    for name, sub in module.named_modules():
        where = repr(name) if name else "the module"
        if pipe is not None and isinstance(sub, pipe.PipelineModule):
            raise ValueError(
                f"{where} is a DeepSpeed PipelineModule: each rank holds only its pipeline "
                "stage, so rank 0 cannot send the model. Sync from a data-parallel engine (ZeRO stage 0-3 "
                "without pipeline parallelism)"
            )
        if tensor_parallel is not None and isinstance(sub, tensor_parallel.TensorParallel_Layer):
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
    _refuse_partial_models(module)
    found = _schemes(module, root)
    if len(found) > 1:
        seen = " and ".join(f"{scheme} ({where})" for scheme, where in found.items())
        raise ValueError(
            f"the module mixes sharding schemes: {seen}. Shard it with one scheme, or send a part "
            "that uses one (module: ...)"
        )
    if FSDP1 in found:
        from wt_callbacks.transfer.sources.fsdp1 import FSDP1Units

        return FSDP1Units(module, submodule)
    if ZERO3 in found:
        from wt_callbacks.transfer.sources.zero3 import Zero3Groups

        return Zero3Groups(root)
    return LocalParameters(root)
