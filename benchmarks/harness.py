"""What the benchmark scripts share: timing, load and memory meters, and the receiver
of the synthetic model.

Imported as ``harness``: a script's own directory is on the import path when it
runs as ``python benchmarks/x.py``.
"""

from __future__ import annotations

import glob
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wt_callbacks.demos.receiver_process import ReceiverProcess, start_receiver
from wt_callbacks.demos.synthetic_llama import PARAMS_ENV
from wt_callbacks.demos.vllm_server import VLLMServer
from wt_callbacks.transfer.backends.torch_dist.shm_files import ring_path
from wt_callbacks.transfer import TrainerWeightTransferEngine, WeightSource, WeightTransferTrainerFactory
from wt_callbacks.transfer.clients import HTTPVLLMWeightSyncClient

MiB = 1024**2
GB = 1e9


def trainer_engine(
    client: HTTPVLLMWeightSyncClient, source: WeightSource, timeout_s: float, config: dict[str, Any] | None = None
) -> TrainerWeightTransferEngine:
    """A ``torch_dist`` trainer engine on 127.0.0.1 (a free port, rank 0) with
    ``config`` on top of ``timeout_s``, as every harness here syncs."""
    return WeightTransferTrainerFactory.trainer_init(
        "torch_dist",
        {"timeout_s": timeout_s, **(config or {})},
        {"master_address": "127.0.0.1", "master_port": 0, "rank": 0},
        client=client,
        source=source,
    )


def start_synthetic_receiver(params_text: str, *, torch_threads: int, timeout_s: float) -> ReceiverProcess:
    """The reference receiver serving the synthetic model of ``params_text``
    (``"200M"``) from another seed; ``torch_threads`` (if > 0) becomes its
    ``OMP_NUM_THREADS``."""
    env = {PARAMS_ENV: params_text}
    if torch_threads > 0:
        env["OMP_NUM_THREADS"] = str(torch_threads)
    return start_receiver("wt_callbacks.demos.synthetic_llama:receiver_model", env=env, timeout_s=timeout_s)


class TimedClient(HTTPVLLMWeightSyncClient):
    """An ``HTTPVLLMWeightSyncClient`` that records ``call -> seconds`` of the
    last round's weight-sync calls in ``self.call_seconds``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.call_seconds: dict[str, float] = {}

    def _timed(self, call: str, fn: Any, *args: Any) -> None:
        start = time.perf_counter()
        try:
            fn(*args)
        finally:
            self.call_seconds[call] = time.perf_counter() - start

    def start_weight_update(self) -> None:
        self.call_seconds = {}
        self._timed("start_weight_update", super().start_weight_update)

    def update_weights(self, update_info: Any) -> None:
        self._timed("update_weights", super().update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._timed("finish_weight_update", super().finish_weight_update, weight_version)


class RssSampler:
    """Peak RSS of this process above a baseline, sampled on a thread every ~``interval_s``."""

    _PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.baseline = 0
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    @classmethod
    def rss(cls) -> int:
        """Current resident set size in bytes (from ``/proc/self/statm``)."""
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * cls._PAGE

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.rss())
            self.samples += 1

    def __enter__(self) -> RssSampler:
        self.baseline = self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.peak = max(self.peak, self.rss())

    @property
    def extra(self) -> int:
        return self.peak - self.baseline


class CpuLoadMeter:
    """Average CPU cores used by *other* processes while the block runs.

    The machine may be shared: anything else running inflates the timings,
    so each configuration reports how busy the rest of the machine was
    (``/proc/stat`` busy time minus this process's and ``pids``' CPU time).
    """

    _TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, *pids: int) -> None:
        self.pids = (os.getpid(), *pids)
        self.other_cores = 0.0

    @classmethod
    def _machine_busy_seconds(cls) -> float:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
        return (user + nice + system + irq + softirq) / cls._TICK

    @classmethod
    def _process_seconds(cls, pid: int) -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / cls._TICK  # utime + stime

    def _snapshot(self) -> tuple[float, float, float]:
        ours = sum(self._process_seconds(pid) for pid in self.pids)
        return time.monotonic(), self._machine_busy_seconds(), ours

    def __enter__(self) -> CpuLoadMeter:
        self._start = self._snapshot()
        return self

    def __exit__(self, *exc: Any) -> None:
        end = self._snapshot()
        wall = end[0] - self._start[0]
        others = (end[1] - self._start[1]) - (end[2] - self._start[2])
        self.other_cores = max(others, 0.0) / wall if wall > 0 else 0.0


def spawn_ranks(fn: Any, args: tuple[Any, ...], nprocs: int, budget_s: float) -> None:
    """``fn(rank, *args)`` in ``nprocs`` spawned processes; wait at most
    ``budget_s``, then kill them by PID and raise. A rank that fails makes
    ``join`` terminate the others and raise."""
    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + budget_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ranks did not finish within {budget_s:g} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)


def server_pids(server: VLLMServer) -> list[int]:
    """The server's processes (launcher, engine core, worker): its process group."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == server.proc.pid:
                pids.append(int(entry.name))
    return pids


@dataclass(frozen=True)
class ProcessStats:
    """Open file descriptors, threads and resident memory of some processes, summed."""

    fds: int
    threads: int
    rss_bytes: int

    _PAGE = os.sysconf("SC_PAGE_SIZE")

    @classmethod
    def of(cls, pids: list[int]) -> ProcessStats:
        fds = threads = rss = 0
        for pid in pids:
            try:
                fds += len(os.listdir(f"/proc/{pid}/fd"))
                threads += len(os.listdir(f"/proc/{pid}/task"))
                with open(f"/proc/{pid}/statm", "rb") as f:
                    rss += int(f.read().split()[1]) * cls._PAGE
            except OSError:  # the process exited meanwhile
                continue
        return cls(fds, threads, rss)

    def row(self) -> dict[str, float]:
        return {"fds": self.fds, "threads": self.threads, "rss_mib": round(self.rss_bytes / MiB, 1)}


def ring_file_count() -> int:
    """Shared-memory ring files of this project in ``/dev/shm`` (any process's)."""
    return len(glob.glob(ring_path("*", "*")))


def checksum_exit_status(failed: list[str]) -> int:
    """A benchmark's exit status: 1, naming them, when some rows did not deliver the weights."""
    if failed:
        print(f"CHECKSUM FAILURE: {failed}", file=sys.stderr)
        return 1
    return 0
