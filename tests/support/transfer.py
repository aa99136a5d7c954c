"""Trainer-side helpers of the end-to-end transfer tests (trainer in the test
process, receivers in their own processes)."""

from __future__ import annotations

import glob
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from wt_callbacks.transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    ParamMeta,
    WeightSource,
    WeightTransferTrainerFactory,
)
from wt_callbacks.transfer.backends.torch_dist.shm_ring import SHM_DIR, SHM_NAME_PREFIX

TIMEOUT_S = 30.0
LOCAL = {"master_address": "127.0.0.1", "master_port": 0, "rank": 0}


def ring_files(created_by: int | None = None) -> set[str]:
    """Our shared-memory ring files in /dev/shm; only those of process ``created_by`` if given
    (tests run in parallel: another test's trainer may hold a ring at the same time)."""
    creator = "*" if created_by is None else f"{created_by}-*"
    return set(glob.glob(os.path.join(SHM_DIR, SHM_NAME_PREFIX + creator)))


def _in_tree_of(pid: int, ancestor: int) -> bool | None:
    """Whether ``pid`` is ``ancestor`` or descends from it; ``None`` once it exited."""
    while pid > 1 and pid != ancestor:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return None
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's pid
    return pid == ancestor


def rings_left_behind(before: set[str]) -> set[str]:
    """Ring files that appeared since ``before``, but those of a live process
    outside this one's tree (a test running in parallel on another worker).
    A ring whose creator exited is always counted: nothing unlinks it now."""
    left = set()
    for path in ring_files() - before:
        creator = os.path.basename(path).removeprefix(SHM_NAME_PREFIX).split("-", 1)[0]
        if not creator.isdigit() or _in_tree_of(int(creator), os.getpid()) is not False:
            left.add(path)
    return left


def connect(urls, source: WeightSource, *, api_key: str | None = None, **config):
    client = HTTPVLLMWeightSyncClient(urls, timeout=TIMEOUT_S, api_key=api_key)
    engine = WeightTransferTrainerFactory.trainer_init(
        "torch_dist", {"timeout_s": TIMEOUT_S, **config}, LOCAL, client=client, source=source
    )
    return client, engine


class InterruptingSource(WeightSource):
    """A source (``ModuleSource(model)`` for a module) that calls ``act``
    before yielding tensor ``after``: kills a receiver, or stalls the
    trainer, in the middle of a round."""

    def __init__(self, model: torch.nn.Module | WeightSource, act: Callable[[], None], after: int = 30) -> None:
        self.inner = model if isinstance(model, WeightSource) else ModuleSource(model)
        self.act = act
        self.after = after

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.inner):
            if i == self.after:
                self.act()
            yield item


def wait_until_update_sent(timeout_s: float = 30.0) -> None:
    """Blocks until this ``torch_dist`` trainer's ``update_weights`` request
    went out whole (its thread waits for the answer, in ``getresponse``).

    The trainer posts it on a thread (``wt-update``) while its main thread
    already broadcasts, and gloo buffers a small model's tensors in the
    socket: on a loaded machine a kill between two tensors can come before
    the request left. The server then never began the round and stays
    paused, as vLLM does (``test_faults.py::test_an_update_a_dead_round_left_open_does_not_block_the_next_trainer``).
    This narrows that race, it does not close it: uvicorn drops a request
    whose client hung up before the route read its body (1 in 100 for a
    client killed right after sending), so a kill just after this returns
    can still come before the server began the round.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        frames = sys._current_frames()
        for thread in threading.enumerate():
            frame = frames.get(thread.ident) if thread.name == "wt-update" else None
            while frame is not None:
                if frame.f_code.co_name == "getresponse":
                    return
                frame = frame.f_back
        time.sleep(0.001)
    raise AssertionError(f"the update_weights request did not go out within {timeout_s:g} s")
