"""Full parameters out of a sharded module, one sharding scheme per gatherer.

A gatherer knows one way of holding parameters across trainer ranks and
turns them into full tensors. ``ModuleSource`` asks ``gather_for(module)``
for the one that fits: the scheme is detected from the module, never
configured, so the same ``weight_sync`` section works under every strategy.

Every gatherer keeps the ``WeightSource`` contract: ``parameters()``
reports full shapes without any communication, ``gather()`` is a
collective every rank runs with the same names in the same order, and the
cast to the wire dtype happens before the gather wherever the scheme
allows (half the bytes gathered for a bf16 wire).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

import torch

from wt_callbacks.transfer.base import ParamMeta, materialize_full_tensor


class ParameterGather(ABC):
    """How one sharding scheme turns a module's parameters into full tensors."""

    scheme: str
    """Name in messages and metrics, e.g. ``"fsdp2"``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    @abstractmethod
    def parameters(self) -> list[ParamMeta]:
        """Every parameter, once (tied ones too), under its name in ``module``
        (wrapper segments included), its own dtype and full shape. No communication."""

    @abstractmethod
    def gather(self, names: Sequence[str], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors of ``names`` (a subset of ``parameters()``, in its
        order), floating-point ones in ``dtype`` (``None``: their own). A
        collective: every rank iterates it to the end with the same arguments.
        A yielded tensor stays valid and unchanged until the round ends."""


def _wire(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor


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
            yield name, materialize_full_tensor(_wire(params[name].detach(), dtype))


def gather_for(module: torch.nn.Module) -> ParameterGather:
    """The gatherer for how ``module``'s parameters are held.

    Raises:
        ValueError: for a scheme whose parameters cannot be sent, naming the
            strategy and what to use instead.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise ValueError(
            "FSDP1 (FullyShardedDataParallel, Lightning's FSDPStrategy, Accelerate fsdp_version: 1) holds "
            "flat shards that cannot be sent yet; use FSDP2 (fully_shard, Lightning's ModelParallelStrategy, "
            "Accelerate fsdp_version: 2), whose parameters are gathered one at a time"
        )
    if any(hasattr(p, "ds_id") and getattr(p, "ds_numel", p.numel()) != p.numel() for p in module.parameters()):
        raise ValueError(
            "DeepSpeed ZeRO stage 3 holds partitioned parameters that cannot be sent yet; use ZeRO stage 1/2 "
            "or FSDP2"
        )
    return LocalParameters(module)
