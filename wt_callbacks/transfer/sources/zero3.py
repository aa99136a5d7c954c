"""DeepSpeed ZeRO-3: full parameters a bounded group at a time.

ZeRO-3 partitions every parameter across the ranks: ``numel()`` of a
partitioned parameter is 0, its full size is ``ds_numel`` and its shape
``ds_shape``. DeepSpeed's ``GatheredParameters`` gathers a list of them (one
coalesced all-gather, in the parameter dtype: it has no way to cast first)
and frees them again on exit, so each tensor is copied out while the group
is gathered (the cast to the wire dtype is that copy). ZeRO-1/2 keep whole
parameters on every rank: ``LocalParameters`` sends them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from wt_callbacks.transfer.weight_source import ParamMeta
from wt_callbacks.transfer.sources.gathering import ParameterGather, in_wire_dtype

GROUP_BYTES = 64 * 1024 * 1024
"""Target size of one gathered group, in the parameters' dtype."""


class Zero3Groups(ParameterGather):
    """ZeRO-3 parameters, gathered with ``GatheredParameters`` a group at a time.

    A group collects parameters in order until its full size (``ds_numel``
    times the element size) exceeds ``group_bytes``, the chunk cut rule of
    the packed transport, so it is at most ``group_bytes`` plus one
    parameter. A LoRA-targeted weight in ``merges`` is gathered in the same
    group as its factors and sent merged (``wt_callbacks.lora.merge``). Peak extra memory: one group plus the copies the transport
    still holds. Parameters ZeRO-3 keeps whole (below
    ``stage3_param_persistence_threshold``) are already available and
    gathered by nobody, as ``GatheredParameters`` does.

    Raises:
        ValueError: parameters offloaded to NVMe (``offload_param: {device:
            nvme}``): a group needs more swap buffers at once than
            DeepSpeed's parameter swapper keeps (``buffer_count``).
    """

    scheme = "zero3"

    def __init__(self, module: torch.nn.Module, group_bytes: int = GROUP_BYTES) -> None:
        super().__init__(module)
        self.group_bytes = group_bytes
        self._params = dict(module.named_parameters())
        for name, param in self._params.items():
            # DeepSpeed marks a partition that lives on NVMe; "nvme" is OffloadDeviceEnum.nvme's value.
            if getattr(getattr(param, "ds_tensor", None), "final_location", None) == "nvme":
                raise ValueError(
                    f"DeepSpeed ZeRO-3 keeps {name!r} on NVMe (offload_param device: nvme): weight sync "
                    "gathers groups of parameters, more at once than DeepSpeed's NVMe swapper holds. "
                    "Use offload_param device: cpu (or none) for a run that syncs its weights"
                )

    def parameters(self) -> list[ParamMeta]:
        return [ParamMeta(name, p.dtype, _full_shape(p)) for name, p in self._params.items()]

    def groups(self, names: Sequence[str]) -> list[list[str]]:
        """``names`` cut into the groups gathered together, in order."""
        groups: list[list[str]] = []
        current: list[str] = []
        size = 0
        for name in names:
            current.append(name)
            merge = self.merges.get(name)
            # A LoRA-merged weight is gathered with its factors, in one group.
            for held in (name, *(merge.factors if merge is not None else ())):
                param = self._params[held]
                size += int(getattr(param, "ds_numel", param.numel())) * param.element_size()
            if size > self.group_bytes:
                groups.append(current)
                current, size = [], 0
        if current:
            groups.append(current)
        return groups

    def gather(self, names: Sequence[str], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        return self._pass(names, dtype, keep=True)  # type: ignore[return-value]

    def gather_only(self, names: Sequence[str], dtype: torch.dtype | None) -> Iterator[str]:
        """The same groups gathered, nothing copied out of them."""
        return (name for name, _ in self._pass(names, dtype, keep=False))

    def _pass(
        self, names: Sequence[str], dtype: torch.dtype | None, *, keep: bool
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        import deepspeed

        for group in self.groups(names):
            factors = list(dict.fromkeys(f for n in group if n in self.merges for f in self.merges[n].factors))
            params = [self._params[name] for name in (*group, *factors)]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                for name, param in zip(group, params):
                    if not keep:
                        yield name, None
                        continue
                    full = param.detach()
                    merge = self.merges.get(name)
                    if merge is not None:  # W, A and B gathered together, merged in float32, then cast
                        yield name, merge.full(full, self._params).to(dtype if dtype is not None else full.dtype)
                        continue
                    sent = in_wire_dtype(full, dtype)
                    # A copy either way: the context frees the gathered data on exit.
                    yield name, sent if sent is not full else full.clone()


def _full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))
