"""Full parameters out of a sharded module, one sharding scheme per gatherer.

A gatherer knows one way of holding parameters across trainer ranks and
turns them into full tensors. ``ModuleSource`` asks ``schemes.gather_for(module,
submodule)`` for the one that fits: the scheme is detected from the module,
never configured, so the same ``weight_sync`` section works under every
strategy. One module per gatherer: ``LocalParameters`` here
(whole tensors), ``fsdp2`` (FSDP2 ``DTensor`` s, a bucket at a time),
``fsdp1`` (FSDP1 units), ``zero3`` (DeepSpeed ZeRO-3 groups).

Every gatherer keeps the ``WeightSource`` contract: ``parameters()``
reports full shapes without any communication, ``gather()`` is a
collective every rank runs with the same names in the same order, and the
cast to the wire dtype happens before the gather wherever the scheme
allows (half the bytes gathered for a bf16 wire).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType

import torch

from wt_callbacks.lora.merge import Merge
from wt_callbacks.transfer.weight_source import ParamMeta


class ParameterGather(ABC):
    """How one sharding scheme turns a module's parameters into full tensors."""

    scheme: str
    """Name in messages and metrics, e.g. ``"fsdp2"``."""

    communicates: bool = True
    """Whether ``gather()`` moves bytes between ranks, so that casting before
    it saves them. Where it does not, ``ModuleSource.iter_uncast`` leaves
    the cast to the transport's copy."""

    merges: Mapping[str, Merge] = MappingProxyType({})
    """LoRA-targeted weights ``gather()`` yields merged with their factors
    (``wt_callbacks.lora.merge``), in float32 and then cast, each where the
    scheme holds its rows; set by ``ModuleSource`` for a PEFT model. The
    factors are parameters of the module, never among the names asked for."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    @abstractmethod
    def parameters(self) -> list[ParamMeta]:
        """Every parameter of the selected submodule, once (tied ones too),
        under its name relative to that submodule (wrapper segments may
        remain), its own dtype and full shape. No communication."""

    def frozen(self) -> set[str]:
        """The names (as ``parameters()`` gives them) of the parameters that
        do not train (``requires_grad`` false). The default reads
        ``named_parameters()``, whose names ``parameters()`` uses."""
        return {name for name, p in self.module.named_parameters() if not p.requires_grad}

    @abstractmethod
    def gather(self, names: Sequence[str], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors of ``names`` (a subset of ``parameters()``, in its
        order), floating-point ones in ``dtype`` (``None``: their own). A
        collective: every rank iterates it to the end with the same arguments.
        A yielded tensor stays valid and unchanged until the round ends."""

    def gather_only(self, names: Sequence[str], dtype: torch.dtype | None) -> Iterator[str]:
        """The collectives of ``gather(names, dtype)``, in the same order, for
        a rank that drops the tensors: yields each name once its gathers are
        done. Gatherers that copy or allocate to produce a full tensor skip
        that here; the default iterates ``gather``."""
        return (name for name, _ in self.gather(names, dtype))


def in_wire_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` cast to the wire ``dtype`` if it is floating point and not
    in it already (``None``: every tensor as it is): the one cast to the
    wire dtype, for the gatherers and for whole buffers alike."""
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor


class LocalParameters(ParameterGather):
    """Parameters that are whole tensors on every rank (single device, DDP,
    DeepSpeed ZeRO-1/2); FSDP2 ``DTensor`` s are ``fsdp2.FSDP2Shards``'."""

    scheme = "local"
    communicates = False

    def parameters(self) -> list[ParamMeta]:
        return [ParamMeta(name, p.dtype, tuple(p.shape)) for name, p in self.module.named_parameters()]

    def gather(self, names: Sequence[str], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        params = dict(self.module.named_parameters())
        for name in names:
            tensor = params[name].detach()
            merge = self.merges.get(name)
            yield name, in_wire_dtype(tensor, dtype) if merge is None else merge.full(tensor, params).to(dtype or tensor.dtype)


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` holds, and so ``save_pretrained``
    writes and a server loads (a MoE router's ``e_score_correction_bias`` in
    DeepSeek-V3 and GLM-4-MoE), each tensor once, under its name relative to
    ``module``. Every scheme here keeps buffers whole on every rank (FSDP1,
    FSDP2 and ZeRO-3 shard parameters only), so they need no gather."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is None or name in sub._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            found[f"{prefix}.{name}" if prefix else name] = buffer
    return found
