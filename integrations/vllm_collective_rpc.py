"""Every worker's reply to a collective RPC is read before the call raises.

vLLM 0.32's ``MultiprocExecutor.collective_rpc`` (the engine core's way of
calling a method on every worker of a TP/PP engine) reads the workers'
reply queues in order and raises at the first reply that reports a failure,
leaving the replies of the workers after it in their queues. Every later
call then reads, from those workers, the reply of a call before it: its
errors come one call late, on another route, and a call can report
success from a worker's earlier reply while that worker failed this one.
Two workers are enough to see it, and the plugin's workers refuse on
purpose (a round that would leave a tensor out, a trainer that died, a
group that cannot form): on a TP=2 server one refused round made the next
two fail with its error, and a round could report success while a worker
kept the old weights.

``read_every_reply`` (installed by ``register()``) wraps that method so
that a call every worker answers and the caller waits for reads every
worker's reply, whatever each says, and then fails naming each worker
that failed and what it said, and which completed: a server whose workers
disagree never reports success, and the next call reads its own replies.
The calls vLLM makes on its hot path (``execute_model`` and the like, which
one worker answers, or which do not wait), and every call on an engine of
one worker, keep vLLM's own reading.

What is read still depends on vLLM: a call that gives up waiting
(``timeout``) leaves the reply of a worker that has not answered yet in
its queue, as vLLM does; the RL routes and the plugin never set one.
``missing_rpc_internals`` names what the wrapper needs from vLLM, and the
worker engine refuses to start without it on a server with several workers
per engine rather than serve with replies out of step.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

EXECUTOR_MODULE = "vllm.v1.executor.multiproc_executor"
_MARK = "_wt_reads_every_reply"
ERROR_CHARS = 500
"""What a failure message quotes of each worker's error."""
_WAITS_FOR_EVERY_WORKER = ("unique_reply_rank", "non_block", "kv_output_aggregator", "ec_output_aggregator")
"""The parameters of ``collective_rpc`` that say whether one call waits for every worker's reply."""


def missing_rpc_internals() -> list[str]:
    """The vLLM internals ``read_every_reply`` relies on that this vLLM lacks ([] when all are there).

    Imports vLLM's executor: call it where vLLM is installed.
    """
    try:
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc
    except ImportError as e:
        return [f"{EXECUTOR_MODULE}.MultiprocExecutor/WorkerProc ({e})"]
    rpc = getattr(MultiprocExecutor, "collective_rpc", None)
    if not callable(rpc):
        return ["MultiprocExecutor.collective_rpc"]
    missing = []
    parameters = inspect.signature(rpc).parameters
    missing += [
        f"MultiprocExecutor.collective_rpc({p}=...)"
        for p in ("method", *_WAITS_FOR_EVERY_WORKER)
        if p not in parameters
    ]
    # How it reads the replies is in its body: the names it must use are what can be checked.
    source = inspect.getsource(rpc)
    for needed, what in (
        ("self.response_mqs", "reads the workers' reply queues from self.response_mqs, at the call"),
        (".dequeue(", "reads each reply with the queue's dequeue()"),
        ("ResponseStatus.SUCCESS", "tells a failed reply by WorkerProc.ResponseStatus"),
    ):
        if needed not in source:
            missing.append(f"MultiprocExecutor.collective_rpc {what}")
    if getattr(getattr(WorkerProc, "ResponseStatus", None), "SUCCESS", None) is None:
        missing.append("WorkerProc.ResponseStatus.SUCCESS")
    return missing


def read_every_reply() -> None:
    """Wrap ``MultiprocExecutor.collective_rpc`` (see the module docstring).

    Patches the class in a process that has imported it when plugins load
    (the engine core is handed the class before); other processes pay
    nothing. Idempotent.
    """
    module = sys.modules.get(EXECUTOR_MODULE)
    executor = getattr(module, "MultiprocExecutor", None)
    worker_proc = getattr(module, "WorkerProc", None)
    rpc = getattr(executor, "collective_rpc", None)
    success = getattr(getattr(worker_proc, "ResponseStatus", None), "SUCCESS", None)
    if rpc is None or success is None or getattr(rpc, _MARK, False):
        return
    signature = inspect.signature(rpc)

    @functools.wraps(rpc)
    def collective_rpc(self: Any, *args: Any, **kwargs: Any) -> Any:
        queues = getattr(self, "response_mqs", None)
        # One worker's reply is read whatever it says: vLLM's reading is right there.
        if not queues or len(queues) < 2 or not _waits_for_every_worker(signature, self, args, kwargs):
            return rpc(self, *args, **kwargs)
        readers = [_ReplyReader(mq, success) for mq in queues]
        self.response_mqs = readers
        try:
            replies = rpc(self, *args, **kwargs)
        finally:
            self.response_mqs = queues
        failed = [(i, r.failure) for i, r in enumerate(readers) if r.failure is not None]
        if failed:
            method = signature.bind(self, *args, **kwargs).arguments.get("method")
            raise _error(method, failed, len(readers), _engine(self))
        return replies

    setattr(collective_rpc, _MARK, True)
    executor.collective_rpc = collective_rpc


def _waits_for_every_worker(signature: inspect.Signature, self: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """The call waits for a reply from every worker: not one worker's
    (``unique_reply_rank``, the aggregators), not a future (``non_block``)."""
    try:
        bound = signature.bind(self, *args, **kwargs).arguments
    except TypeError:
        return False  # vLLM raises its own error for it
    return (
        bound.get("unique_reply_rank") is None
        and not bound.get("non_block")
        and bound.get("kv_output_aggregator") is None
        and bound.get("ec_output_aggregator") is None
    )


_NO_REPLY = "no reply within the call's timeout (its reply will come to a later call)"


class _ReplyReader:
    """One worker's reply queue for one call: a failed reply (or none in
    time) is kept and passed on as a success, so vLLM reads the next
    worker's reply too."""

    def __init__(self, queue: Any, success: Any) -> None:
        self._queue = queue
        self._success = success
        self.failure: str | None = None

    def dequeue(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        try:
            status, result = self._queue.dequeue(*args, **kwargs)
        except TimeoutError:
            self.failure = _NO_REPLY
            return self._success, None
        if status != self._success:
            self.failure = str(result)
            return self._success, None
        return status, result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def _engine(executor: Any) -> str:
    """Which data-parallel engine the executor runs. vLLM runs each engine of
    a dense model as a deployment of its own (``data_parallel_size`` 1), its
    ``data_parallel_index`` alone telling it apart: engine 0 goes unnamed."""
    parallel = getattr(getattr(executor, "vllm_config", None), "parallel_config", None)
    index = getattr(parallel, "data_parallel_index", 0)
    if index or getattr(parallel, "data_parallel_size", 1) > 1:
        return f" of data-parallel engine {index}"
    return ""


def _error(method: Any, failed: list[tuple[int, str]], workers: int, engine: str = "") -> Exception:
    """Which workers failed and which completed, first (a caller may cut a
    long message), then what the failed ones said, in vLLM's words, each
    error once (cut at ``ERROR_CHARS``: the workers' log has it whole)."""
    name = method if isinstance(method, str) else getattr(method, "__name__", "a function")
    by_error: dict[str, list[int]] = {}
    for i, error in failed:
        gist = error if len(error) <= ERROR_CHARS else error[:ERROR_CHARS] + "..."
        by_error.setdefault(gist, []).append(i)
    completed = sorted(set(range(workers)) - {i for i, _ in failed})
    message = f"{name} failed on {_workers([i for i, _ in failed])} of {workers}{engine}"
    if completed:
        message += f" ({_workers(completed)} completed it: the workers disagree)"
    message += ". " + "; ".join(f"{_workers(ids)}: Worker failed with error '{gist}'" for gist, ids in by_error.items())
    if all(error == _NO_REPLY for _, error in failed):
        return TimeoutError(f"RPC call to {name} timed out: {message}")
    return RuntimeError(message)


def _workers(ids: list[int]) -> str:
    return f"worker {ids[0]}" if len(ids) == 1 else f"workers {', '.join(map(str, ids))}"


def require_rpc_internals(world_size: int) -> None:
    """At a worker engine's init: on an engine with several workers, refuse
    to run where ``read_every_reply`` cannot work (``world_size``: the
    engine's workers, TP x PP). One worker has no replies to get out of step."""
    if world_size <= 1:
        return
    missing = missing_rpc_internals()
    if missing:
        import vllm

        raise RuntimeError(
            f"wt_callbacks' torch_dist engine cannot keep the {world_size} workers' replies in step on vLLM "
            f"{vllm.__version__}: the executor internals {missing} are gone, and a failed update would make "
            "later calls read earlier replies. Use the vLLM version wt_callbacks supports (0.32)"
        )
