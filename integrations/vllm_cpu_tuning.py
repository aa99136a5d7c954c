"""CPU performance adjustments of the vLLM plugin, each applied where it acts.

Into a CPU server they halve the seconds of a push (``benchmarks/README.md``):

* **Engine-core polling** (``poll_during_updates``, installed by ``register()``).
  vLLM's executor waits for a worker's reply by spinning on ``sched_yield``
  for up to 1 s after its previous read (``SpinCondition.busy_loop_s``), so
  during an update (which follows ``start_weight_update`` at once) the engine
  core keeps a core busy doing nothing. The update needs the cores: the
  worker receives and repacks while the trainer, often on the same host,
  packs and sends. Polling costs one wake-up per call, nothing next to an
  update.
* **Worker polling within an update session** (``WorkerPolls``, found by
  ``register()``, used by the worker's engine from start to finish). The
  worker spins the same way after each RPC while it waits for the next one;
  between our start and update calls that spin took a core from the API
  server and engine core forwarding the update call (and from a trainer on
  the same host streaming into the ring): the worker began receiving 16.9 ms
  after its start returned, 7.0 ms without the spin (74M Llama, medians of 12
  rounds). vLLM's notify wakes a polling reader at once; the spin is back at
  finish, for serving. Only while the engine does not step: in a session of
  staged rounds (the server generates while they stream) neither polling
  applies, since a queue switched to waiting on notifications while steps
  keep it busy answered up to 5 s late (vLLM's recheck interval).
* **Freed host memory kept** (``keep_freed_host_memory``, by a CPU worker's
  engine). Every round allocates a model's worth of host memory (layerwise
  reload materializes each layer; the CPU kernels repack each Linear weight)
  and frees the previous round's. glibc serves blocks that large with
  ``mmap`` and unmaps them on free, so each round page-faulted all of it in
  afresh: for a 300 MB model ~64k faults, 0.1 s of the worker's 0.25 s of
  post-processing. Kept in the heap, the freed blocks serve the next round;
  the worker's resident memory stays at its peak instead. This is what
  vLLM's recommended tcmalloc does on CPU (and tcmalloc ignores these).
  Bounded (``HeapBound``): where a worker grows past twice its largest
  round over its size after its first round, and after every round received
  in mapped memory (``WT_STAGING_MEMORY``), the freed memory goes back to
  the OS.

Both pollings lean on vLLM internals that an upgrade may move; where they are
gone, vLLM's own waiting stays and pushes get slower, nothing breaks.
``missing_vllm_internals()`` lists what is gone (the vLLM tests fail on it),
and the process each adjustment acts in logs once whether it was applied,
or why not.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import logging
import sys
import threading
import time
from typing import Any

from wt_callbacks.host_memory import status_bytes

# Under vLLM's logger, whose handler vLLM sets up in every process it starts:
# the lines land in the server's log, at vLLM's log level.
logger = logging.getLogger(f"vllm.{__name__}")

EXECUTOR_MODULE = "vllm.v1.executor.multiproc_executor"
POLLING = "poll instead of spinning while the workers run update_weights"
WORKER_POLLING = "the worker polls instead of spinning between the calls of an update session"
KEEP_MEMORY = "keep freed host memory in the heap (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=-1, M_ARENA_MAX=1)"

_reported: set[str] = set()


def _report_once(adjustment: str, where: str, outcome: str, *, level: int = logging.INFO) -> None:
    """One line per adjustment and process: applied, or not and why."""
    if adjustment in _reported:
        return
    _reported.add(adjustment)
    logger.log(level, "wt_callbacks CPU tuning in %s: %s: %s", where, adjustment, outcome)


def missing_vllm_internals() -> list[str]:
    """The vLLM internals engine-core polling relies on that this vLLM lacks ([] when all are there).

    Imports vLLM's executor: call it where vLLM is installed.
    """
    try:
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    except ImportError as e:
        return [f"{EXECUTOR_MODULE}.MultiprocExecutor ({e})"]
    missing = []
    if not callable(getattr(MultiprocExecutor, "collective_rpc", None)):
        missing.append("MultiprocExecutor.collective_rpc")
    # Instance attributes, set in methods: their names in the source are what can be checked.
    if "response_mqs" not in inspect.getsource(MultiprocExecutor):
        missing.append("MultiprocExecutor.response_mqs (the queues of the workers' replies)")
    from vllm.v1.executor.multiproc_executor import WorkerProc

    if not callable(getattr(WorkerProc, "worker_busy_loop", None)):
        missing.append("WorkerProc.worker_busy_loop")
    elif "rpc_broadcast_mq" not in inspect.getsource(WorkerProc.worker_busy_loop):
        missing.append("WorkerProc.rpc_broadcast_mq (the queue the worker reads RPCs from)")
    try:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue, SpinCondition
    except ImportError as e:
        return [*missing, f"vllm.distributed.device_communicators.shm_broadcast.MessageQueue/SpinCondition ({e})"]
    if "_spin_condition" not in inspect.getsource(MessageQueue):
        missing.append("MessageQueue._spin_condition")
    if "busy_loop_s" not in inspect.signature(SpinCondition).parameters:
        missing.append("SpinCondition(busy_loop_s=...)")
    return missing


def poll_during_updates(backend: str) -> None:
    """Make the engine core wait for ``update_weights`` of ``backend`` without spinning.

    Patches the executor class in a process that has imported it when plugins
    load (the engine core is handed the class before); other processes pay
    nothing. The engine core reports at its first update, when it sees the
    queues it waits on.
    """
    module = sys.modules.get(EXECUTOR_MODULE)
    if module is None:
        return
    executor = getattr(module, "MultiprocExecutor", None)
    spinning_rpc = getattr(executor, "collective_rpc", None)
    if spinning_rpc is None:
        _report_once(
            POLLING,
            "this vLLM process",
            f"not applied: {EXECUTOR_MODULE}.MultiprocExecutor.collective_rpc is gone",
            level=logging.WARNING,
        )
        return
    if getattr(spinning_rpc, "_wt_polls_updates", False):
        return

    @functools.wraps(spinning_rpc)
    def collective_rpc(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        config = getattr(self.vllm_config, "weight_transfer_config", None)
        if method != "update_weights" or getattr(config, "backend", None) != backend or _staged(args, kwargs):
            return spinning_rpc(self, method, *args, **kwargs)
        # Whatever is not there keeps vLLM's own waiting.
        conditions = [getattr(mq, "_spin_condition", None) for mq in getattr(self, "response_mqs", ())]
        conditions = [c for c in conditions if c is not None and hasattr(c, "busy_loop_s")]
        if conditions:
            _report_once(POLLING, "the vLLM engine core", f"applied ({len(conditions)} response queue(s))")
        else:
            _report_once(
                POLLING,
                "the vLLM engine core",
                "not applied: the executor's response queues have no _spin_condition.busy_loop_s",
                level=logging.WARNING,
            )
        saved = [c.busy_loop_s for c in conditions]
        for c in conditions:
            c.busy_loop_s = 0
        try:
            return spinning_rpc(self, method, *args, **kwargs)
        finally:
            for c, busy_loop_s in zip(conditions, saved):
                c.busy_loop_s = busy_loop_s

    collective_rpc._wt_polls_updates = True  # type: ignore[attr-defined]
    executor.collective_rpc = collective_rpc


def _staged(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an ``update_weights`` call (``collective_rpc``'s ``args`` and
    ``kwargs``, which carry the call's own ``kwargs``) is a staged update: it
    returns at once, and the engine goes on stepping while it streams, so its
    wait is vLLM's own. A queue switched to waiting on notifications while
    steps keep it busy answered up to 5 s late (vLLM's recheck interval)."""
    call_kwargs = kwargs.get("kwargs", args[2] if len(args) > 2 else None)
    info = call_kwargs.get("update_info") if isinstance(call_kwargs, dict) else None
    return any(isinstance(entry, dict) and entry.get("staged") for entry in (info if isinstance(info, list) else [info]))


_WORKER_QUEUES: list[Any] = []
"""This worker's RPC queue (``WorkerProc.rpc_broadcast_mq``), once its busy loop started."""


def find_worker_queue() -> None:
    """Remember the worker's RPC queue when its busy loop starts, for ``WorkerPolls``.

    Plugins load in a worker while ``WorkerProc`` is being built, before its
    busy loop runs, so wrapping the class's ``worker_busy_loop`` sees the
    queue. Other processes pay nothing.
    """
    module = sys.modules.get(EXECUTOR_MODULE)
    worker_proc = getattr(module, "WorkerProc", None)
    busy_loop = getattr(worker_proc, "worker_busy_loop", None)
    if busy_loop is None or getattr(busy_loop, "_wt_finds_queue", False):
        return

    @functools.wraps(busy_loop)
    def worker_busy_loop(self: Any) -> Any:
        _WORKER_QUEUES.append(getattr(self, "rpc_broadcast_mq", None))
        return busy_loop(self)

    worker_busy_loop._wt_finds_queue = True  # type: ignore[attr-defined]
    worker_proc.worker_busy_loop = worker_busy_loop


class WorkerPolls:
    """While an update session is open, this worker waits for the next RPC without spinning."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, float]] = []

    def enter(self) -> None:
        """At ``start_weight_update``; a second call keeps the values to restore."""
        if self._saved:
            return
        for mq in _WORKER_QUEUES:
            condition = getattr(mq, "_spin_condition", None)
            if condition is not None and hasattr(condition, "busy_loop_s"):
                self._saved.append((condition, condition.busy_loop_s))
                condition.busy_loop_s = 0
        if self._saved:
            _report_once(WORKER_POLLING, "this vLLM worker", "applied")
        else:
            _report_once(
                WORKER_POLLING,
                "this vLLM worker",
                "not applied: no RPC queue with _spin_condition.busy_loop_s was found",
                level=logging.WARNING,
            )

    def exit(self) -> None:
        """At finish, or when a failed round is abandoned: the spin is back for serving."""
        for condition, busy_loop_s in self._saved:
            condition.busy_loop_s = busy_loop_s
        self._saved.clear()


HEAP_ALLOWANCE_ROUNDS = 2
"""What ``HeapBound`` lets a worker hold over the level its first round left,
in rounds (the largest it received)."""


class HeapBound:
    """Keeps what ``keep_freed_host_memory`` keeps within ``HEAP_ALLOWANCE_ROUNDS``
    rounds' bytes (the largest this worker received) over the worker's
    resident memory after its first round.

    Freed memory kept in the heap serves the next round only where it fits.
    On a server that generates meanwhile, the requests' own allocations come
    from the same heap and split it up, and blocks a round freed stayed kept
    while the next round took fresh memory: measured at 74M fp32 under 8
    streaming clients, 128 rounds in 12 sessions (inline, staged and
    prepared in turn), the worker grew by 2457 MB, still growing, against
    936 MB with nothing kept. So after each round, once the worker holds
    more than that bound, the heap is trimmed (``malloc_trim``: every whole
    free page goes back to the OS), on a thread of its own, so the round
    that asked is not held up by it: the same load then held the worker at
    +241-948 MB. A round after a trim page-faults its memory in again: under
    that load staged and prepared rounds took 1.2-1.5x as long at two
    rounds' allowance, 1.5-1.9x at one. An idle server stays under it.
    After a round received in mapped memory the heap is trimmed whatever it
    holds (``after_round``'s ``trim``).
    """

    def __init__(self) -> None:
        self._trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
        self._base: int | None = None
        self._allowance = 0
        self.trims = 0

    def after_round(self, round_bytes: int, *, trim: bool = False) -> None:
        """Measure the worker after a round of ``round_bytes``; trim the heap
        where it holds more than the bound, or whatever it holds if ``trim``
        (a round received in mapped memory, ``WT_STAGING_MEMORY``: what its
        processing freed in the heap are the previous kernels, and keeping
        them would hold a second copy beside the next round)."""
        if self._trim is None:
            return
        resident = _resident_anonymous_bytes()
        self._allowance = max(self._allowance, HEAP_ALLOWANCE_ROUNDS * round_bytes)
        if self._base is None:
            self._base = resident
        if trim:
            why = "after a round received in mapped memory"
        elif resident > self._base + self._allowance:
            why = f"over its bound of {(self._base + self._allowance) / 1e6:.0f} MB"
        else:
            return
        self.trims += 1
        threading.Thread(target=self._trimmed, args=(resident, why), name="wt-heap-trim", daemon=True).start()

    def _trimmed(self, before: int, why: str) -> None:
        start = time.perf_counter()
        self._trim(0)
        logger.info(
            "wt_callbacks: the worker held %.0f MB, %s; trimmed its heap to %.0f MB in %.3f s",
            before / 1e6, why, _resident_anonymous_bytes() / 1e6, time.perf_counter() - start,
        )  # fmt: skip


def _resident_anonymous_bytes() -> int:
    """This process's anonymous resident memory; 0 where the kernel does not
    report it (the bound then never trims)."""
    try:
        return status_bytes("RssAnon")
    except (KeyError, OSError):
        return 0


def keep_freed_host_memory(device: Any) -> HeapBound | None:
    """Keep freed memory in this process's heap instead of returning it to the OS
    (a worker whose weights live on ``device``: host memory only).

    Threads created from now on (the staging thread of each ``commit:
    staged``/``prepared`` round) share the arenas that exist instead of
    getting one of their own: a prepared round allocates the layers' new
    kernels on that thread, and freed memory a heap keeps serves only that
    heap, so the previous round's kernels, freed at the commit, would never
    be reused and each thread's arena would grow by a model (measured at
    296M fp32, 3 prepared rounds: the worker's peak growth 3.13x the weights
    with arenas per thread, 2.05-2.82x shared: arenas made before this call
    stay, and a new thread may be given any of them). Returns the
    ``HeapBound`` to call after each round where applied."""
    if device.type != "cpu":
        _report_once(KEEP_MEMORY, "this vLLM worker", f"not applied: the weights live on {device}, not in host memory")
        return None
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8
    if mallopt is None:
        outcome = "not applied: the C library has no mallopt (not glibc)"
    elif not all([mallopt(m_mmap_max, 0), mallopt(m_trim_threshold, -1), mallopt(m_arena_max, 1)]):
        outcome = "not applied: mallopt refused"
    else:
        _report_once(KEEP_MEMORY, "this vLLM worker", "applied")
        return HeapBound()
    _report_once(KEEP_MEMORY, "this vLLM worker", f"{outcome}; every round page-faults its memory in", level=logging.WARNING)
    return None
