"""The trainer's full weights under every sharding scheme, gathered
independently of the sources under test: FSDP1's ``summon_full_params``,
DeepSpeed ZeRO-3's ``GatheredParameters`` over every parameter, FSDP2's
``full_tensor()``. Keyed by checkpoint name; a collective (every rank calls it)."""

from __future__ import annotations

import torch

from wt_callbacks.checksums import tensor_sha256
from wt_callbacks.naming import checkpoint_name, unwrap_data_parallel
from wt_callbacks.transfer import materialize_full_tensor


def _copy(tensor: torch.Tensor, via_dtype: torch.dtype | None) -> torch.Tensor:
    # Always a copy: hashing goes through numpy, which would pin FSDP1's
    # unsharded storage and break summon_full_params' exit.
    tensor = materialize_full_tensor(tensor.detach())
    if via_dtype is not None and tensor.is_floating_point():
        return tensor.to(via_dtype).to(tensor.dtype)
    return tensor.clone()


def full_state(module: torch.nn.Module, *, via_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Copies of every parameter, whole; ``via_dtype`` rounds floating-point
    ones through a wire dtype, as a receiver holding their dtype stores them."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    module = unwrap_data_parallel(module)
    params = list(module.parameters())
    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        with FullyShardedDataParallel.summon_full_params(module, writeback=False):
            return {checkpoint_name(n): _copy(p, via_dtype) for n, p in module.named_parameters()}
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {checkpoint_name(n): _copy(p, via_dtype) for n, p in module.named_parameters()}
    return {checkpoint_name(n): _copy(p, via_dtype) for n, p in module.named_parameters()}


def full_checksums(module: torch.nn.Module, *, via_dtype: torch.dtype | None = None) -> dict[str, str]:
    """``tensor_sha256`` of ``full_state``: what a receiver must hold after a sync."""
    return {name: tensor_sha256(t) for name, t in full_state(module, via_dtype=via_dtype).items()}
