"""Staging on the worker: where a staged round is received, at what niceness, into what memory.

A ``commit: staged`` round is received on a thread of its own while the
server keeps generating, and applied at finish (``worker``). What a server's
environment sets about that thread, and about the memory a round the worker
holds whole comes in, is read here once, when the engine starts; a value it
cannot take fails that start, naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from wt_callbacks.transfer.validation import check_niceness


class StagedTensors:
    """Where a host that applies a staged round at finish (the vLLM plugin)
    receives it: the round's ``(name, tensor)`` pairs as they arrived, views
    of the receive buffers, which hold a whole round (each chunk its own).
    ``drain`` hands them over at the commit and lets go of each as it goes:
    a chunk in mapped memory (``WT_STAGING_MEMORY``) goes back to the OS once
    the layers it fed were processed."""

    copies_loaded_tensors = False

    def __init__(self) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights: Any) -> None:
        self.tensors.extend(weights)

    def drain(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The staged pairs in the order they arrived, each removed as it is handed out."""
        self.tensors.reverse()
        while self.tensors:
            yield self.tensors.pop()


STAGING_NICE_ENV = "WT_STAGING_NICE"
"""The niceness (0-19, default 0) the thread a staged round is received
(and, under ``commit: prepared``, processed) on in a server's process runs
at, at least."""


def staging_nice() -> int:
    """``WT_STAGING_NICE`` of this process, checked (at the engine's start).

    Staging runs beside generation on the server's cores. A server saturated
    with requests slows them for the length of every staged round; a higher
    niceness gives generation the cores first, and the round takes longer:
    measured under 8 streaming clients on 2 cores (``commit: prepared``, 74M
    fp32), p99 latency of requests straddling a sync over those clear of
    syncs 1.63 at 0, 1.26 at 10 and 1.19 at 19, rounds taking 0.64 s, 1.82 s
    and 4.6 s. Worth it where rounds are off the trainer's critical path
    (``send: async``); under ``send: blocking`` the trainer waits for them.
    A round may ask for more (its ``staging_nice``), never for less."""
    value = os.environ.get(STAGING_NICE_ENV, "").strip()
    if not value:
        return 0
    try:
        nice = int(value)
    except ValueError:
        nice = -1
    check_niceness(STAGING_NICE_ENV, nice, shown=value)
    return nice


STAGING_MEMORY_ENV = "WT_STAGING_MEMORY"
"""What a server's process receives a round it holds whole into (the vLLM
plugin's rounds, staged or inline): ``heap`` (default) or ``mapped``."""

STAGING_MEMORY = ("heap", "mapped")


def staging_memory() -> str:
    """``WT_STAGING_MEMORY`` of this process, checked (at the engine's start).

    A round whose target keeps views of what arrived (vLLM's layerwise
    reload, or the plugin's staging) holds it whole until its layers are
    processed. ``heap``: in receive buffers kept between rounds, from the
    heap the worker keeps freed memory in (the plugin's
    ``keep_freed_host_memory``), so no round page-faults fresh memory; the
    worker then holds the buffers and the heap's holes beside the model.
    ``mapped``: in memory mapped for the round, which the OS takes back chunk
    by chunk as the layers are processed, and the plugin trims its heap after
    each such round (the previous kernels it freed): the worker holds about
    the round beyond the model, at the cost of page faults, in the staging
    (beside generation) and in the processing. Measured at 296M fp32 into
    vLLM, ``commit: staged``, 6 rounds into an idle server: the worker's peak
    1.65x the weights with ``heap``, 1.07x with ``mapped``; a round 0.72 s
    against 1.61 s (benchmarks README)."""
    value = os.environ.get(STAGING_MEMORY_ENV, "").strip() or STAGING_MEMORY[0]
    if value not in STAGING_MEMORY:
        raise ValueError(f"{STAGING_MEMORY_ENV}={value!r} must be one of {', '.join(STAGING_MEMORY)}")
    return value
