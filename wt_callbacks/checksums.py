"""Bitwise fingerprints of weights, to prove a sync was exact.

A checksum is the sha256 of a tensor's raw bytes (C-contiguous, on CPU, in the
tensor's own dtype). The receiver exposes them at ``GET /weight_checksums``;
the trainer computes the same over its model, and equal dicts mean every
parameter arrived bit for bit.

A vLLM server holds its weights fused, sharded over its workers and, on CPU,
packed into kernels, so its checksums cannot be compared with a trainer's.
They can with another server's of the same topology: ``served_checksums``
asks every worker of every engine what it serves (vLLM's ``/weight_checker``,
with our plugin's CPU kernels added), and ``checksum_mismatches`` between a
server after its rounds and one loaded from a checkpoint of the same weights
(or the same server, loaded from it before) proves every worker's weights
bit for bit, where logprobs cannot tell or generation does not run.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

import torch

from wt_callbacks.transfer.auth import bearer_headers
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


_WORKER_PREFIX = re.compile(r"^((?:[a-z]+\d+:)+)(.+)$")
"""vLLM's key of a worker's checksum: ``dp0:pp1:pcp0:tp0:<parameter>``."""


def served_checksums(
    url: str, *, api_key: str | None = None, timeout_s: float = 300.0
) -> dict[str, dict[str, str]]:
    """Checksums of what every worker of a vLLM server serves, by worker.

    Keys are the workers (``"dp0:pp1:pcp0:tp0"``: data-parallel engine,
    pipeline stage, context- and tensor-parallel rank), values map the
    worker's served parameters to their sha256; with the plugin on a CPU
    server, every layer whose kernel holds its weight also has the checksum
    of that weight (``<layer>.weight@cpu_kernel``). Needs
    ``VLLM_SERVER_DEV_MODE=1`` (vLLM's ``POST /weight_checker``).

    Raises:
        RuntimeError: the server does not answer, or has no ``/weight_checker``.
    """
    import requests

    headers = bearer_headers(api_key)
    route = f"{url.rstrip('/')}/weight_checker"
    answer = requests.post(route, json={"action": "checksum"}, headers=headers, timeout=timeout_s)
    if answer.status_code != 200:
        hint = (
            ": vLLM serves it with VLLM_SERVER_DEV_MODE=1 (the reference receiver serves GET /weight_checksums instead)"
            if answer.status_code == 404
            else ""
        )
        raise RuntimeError(f"POST {route} answered {answer.status_code}{hint}: {answer.text[:300]}")
    workers: dict[str, dict[str, str]] = {}
    for key, digest in answer.json()["checksums"].items():
        match = _WORKER_PREFIX.match(key)
        worker, name = (match[1].rstrip(":"), match[2]) if match else ("", key)
        workers.setdefault(worker, {})[name] = digest
    return workers


def checksum_mismatches(expected: Mapping[str, Mapping[str, str]], actual: Mapping[str, Mapping[str, str]]) -> list[str]:
    """What differs between two ``served_checksums`` (``[]``: every worker
    serves the same, bit for bit): ``"<worker> <name>"`` per tensor whose
    checksum differs or that only one side has, and ``"<worker>"`` for a
    worker only one side has."""
    out = []
    for worker in sorted(expected.keys() | actual.keys()):
        if worker not in expected or worker not in actual:
            out.append(worker)
            continue
        a, b = expected[worker], actual[worker]
        out += [f"{worker} {name}" for name in sorted(a.keys() | b.keys()) if a.get(name) != b.get(name)]
    return out
