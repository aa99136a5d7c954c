"""Bitwise fingerprints of weights, to prove a sync was exact.

A checksum is the sha256 of a tensor's raw bytes (C-contiguous, on CPU, in the
tensor's own dtype). The receiver exposes them at ``GET /weight_checksums``;
the trainer computes the same over its model, and equal dicts mean every
parameter arrived bit for bit.
"""

from __future__ import annotations

import hashlib

import torch

from wt_callbacks.transfer.base import materialize_full_tensor
from wt_callbacks.transfer.sources.gathering import persistent_buffers


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 hex digest of ``tensor``'s bytes."""
    data = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def module_checksums(module: torch.nn.Module, *, via_dtype: torch.dtype | None = None) -> dict[str, str]:
    """Checksums of ``module.named_parameters()`` and its persistent buffers
    (what a sync sends), keyed by name.

    FSDP2-sharded parameters are gathered (a collective: call it on every
    rank). ``via_dtype`` rounds floating-point tensors through a wire dtype
    first: what a receiver holding the model's dtype stores after a sync with
    ``dtype=via_dtype``.
    """
    out = {}
    for name, param in [*module.named_parameters(), *persistent_buffers(module).items()]:
        tensor = materialize_full_tensor(param.detach())
        if via_dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(via_dtype).to(param.dtype)
        out[name] = tensor_sha256(tensor)
    return out
