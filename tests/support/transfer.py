"""Trainer-side helpers of the end-to-end transfer tests (trainer in the test
process, receivers in their own processes)."""

from __future__ import annotations

import glob
import os
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
from wt_callbacks.transfer.backends.torch_dist.shm_files import ring_creator, ring_path

TIMEOUT_S = 30.0
LOCAL = {"master_address": "127.0.0.1", "master_port": 0, "rank": 0}


def ring_files(created_by: int | None = None) -> set[str]:
    """Our shared-memory ring files in /dev/shm; only those of process ``created_by`` if given
    (tests run in parallel: another test's trainer may hold a ring at the same time)."""
    return set(glob.glob(ring_path("*" if created_by is None else created_by, "*")))


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
        creator = ring_creator(path)
        if creator is None or _in_tree_of(creator, os.getpid()) is not False:
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


def wait_until_update_began(server_log: str, line: str, rounds: int, *, from_byte: int = 0, timeout_s: float = 30.0) -> None:
    """Blocks until the server's log (the file ``server_log``, from byte
    ``from_byte`` on) holds ``line`` ``rounds`` times: its worker began to
    receive that many updates. One worker per server: each logs the line.

    A trainer posts ``update_weights`` on a thread while its main thread
    already broadcasts, and gloo (or the shm ring) buffers a small model's
    tensors: a kill "between two tensors" can come before the request left,
    or after it left but before the server read it (uvicorn then drops it).
    Either way the server never began the round and stays paused, as vLLM
    does, and the test would measure a different fault. Only the server can
    say it began, so the wait reads what the server wrote.
    """
    deadline = time.monotonic() + timeout_s
    needle, written = line.encode(), b""
    with open(server_log, "rb") as log:
        log.seek(from_byte)
        while time.monotonic() < deadline:
            written += log.read()  # what the server wrote since from_byte: a few KB
            if written.count(needle) >= rounds:
                return
            time.sleep(0.01)
    raise AssertionError(f"{server_log} did not show {line!r} {rounds} times within {timeout_s:g} s")
