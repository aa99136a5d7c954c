"""The rendezvous store and the ``TransferGroup`` of ``torch_dist``.

The group is built without touching torch.distributed's global state (a
training job already has its own default group): trainer rank 0 runs a
``TCPStore`` master on ``master_address:master_port``; every inference worker
connects to it and joins a ``ProcessGroupGloo`` (CPU tensors) or
``ProcessGroupNCCL`` (CUDA tensors) under a ``PrefixStore``. Every wait is
bounded by ``timeout_s``: a dead peer raises, it never hangs, and so does a
frozen trainer, whose store never answers a worker (``waits.trainer_store_call``).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any

import torch
import torch.distributed as dist

from wt_callbacks.transfer.backends.torch_dist.addresses import local_address_towards
from wt_callbacks.transfer.backends.torch_dist.session import check_peers, store_prefix
from wt_callbacks.transfer.backends.torch_dist.shm_negotiation import join_ring, offer_ring
from wt_callbacks.transfer.backends.torch_dist.shm_ring import ShmRing
from wt_callbacks.transfer.backends.torch_dist.waits import trainer_store_call
from wt_callbacks.transfer.base import CLEANUP_TIMEOUT_S, WeightTransferError, in_daemon_thread

logger = logging.getLogger(__name__)

_TRAINER_LEFT_KEY = "trainer_left"
_STAGED_KEY = "staged"
"""Counts the staged updates the workers ended receiving (``signal_staged``)."""
_STAGED_SIGNAL_KEY = "staged_signal"
"""Counts the workers that signal it: a server older than the signal never does."""
STAGED_POLL_S = 0.001
WAIT_SLICE = datetime.timedelta(milliseconds=100)
"""How often a worker waiting for a gloo broadcast asks whether the trainer left."""


def open_store(
    master_address: str, master_port: int, world_size: int, *, is_master: bool, timeout_s: float
) -> dist.TCPStore:
    """Rendezvous store; the master binds ``master_address:master_port``.

    A worker first checks that the store listens: the trainer opens it
    before it calls the servers, so a refused connection means the trainer
    gave up (a call that reached a server late), and failing at once beats
    TCPStore's retrying for ``timeout_s``. A frozen trainer's kernel still
    accepts the connection, and the client then waits for the store's
    handshake with no time limit: bounded on a thread.
    """

    def connect() -> dist.TCPStore:
        return dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=is_master,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )

    try:
        if is_master:
            return connect()
        socket.create_connection((master_address, master_port), timeout=timeout_s).close()
        return trainer_store_call(connect, "the store's handshake", timeout_s=timeout_s)
    except (RuntimeError, OSError) as e:
        if is_master:
            raise WeightTransferError(
                f"cannot listen on master_address={master_address!r} master_port={master_port}: {e}. "
                "Pick a free port (or 0 for any free port) and an address of this machine that the "
                "servers can reach"
            ) from e
        raise WeightTransferError(
            f"cannot reach the trainer's rendezvous store at {master_address}:{master_port} "
            f"within {timeout_s:g} s: {e}"
        ) from e


class TransferGroup:
    """The trainer plus inference workers: one stateless process group.

    ``broadcast`` is asynchronous and returns a work handle; rank 0 is always
    the source; workers wait for it with ``wait_received``. ``destroy``
    leaves the group so that a peer stuck in a collective with us fails at
    once instead of at its timeout. ``transport`` says what broadcasts travel
    over: ``"gloo"``, ``"nccl"`` or ``"shm"`` (the ring ``shm``; the gloo
    group is still there). ``store``: the session's view of the rendezvous
    store (it keeps the trainer's store alive).
    """

    def __init__(self, store: dist.Store, pg: Any, rank: int, world_size: int, device: torch.device,
                 shm: ShmRing | None = None, *, timeout_s: float = 300.0) -> None:  # fmt: skip
        self.store = store
        self.timeout_s = timeout_s  # the group's: what bounds its pending operations
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.shm = shm
        self.transport = "shm" if shm is not None else "nccl" if device.type == "cuda" else "gloo"
        self._in_flight: deque[Any] = deque()
        self._store_server: dist.TCPStore | None = None
        self._left_asked: Future | None = None  # a worker's pending "did the trainer leave?"
        self._staged_rounds = 0  # rank 0: staged rounds streamed in this group
        self._signals: dist.Store | None = None
        """A worker's own client of the store, for ``signal_staged``: the
        group's may be in a question on another thread (``_trainer_left``),
        and a client takes one call at a time."""

    @classmethod
    def connect(
        cls,
        store: dist.Store,
        *,
        master_address: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        transport: str,
        device: torch.device,
        session_id: str | None = None,
        fallback_to_gloo: bool = False,
    ) -> TransferGroup:
        """Join the group (blocks until every rank joined, at most ``timeout_s``).

        With a ``session_id`` the store keys are that session's and every
        rank proves it holds the secret before anything else (``session``).
        ``transport="shm"`` then negotiates the ring (``shm_negotiation``);
        ``fallback_to_gloo`` matters on rank 0 only, which decides for every
        rank: when a rank cannot map the ring, use gloo broadcasts (``True``,
        what ``auto`` asks for) or fail naming the fix.
        """
        prefix = dist.PrefixStore(store_prefix(session_id), store)
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if transport == "nccl":
                # Untested here (no GPU): the CPU build of torch has no NCCL.
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
            else:
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(master_address))]

                def gloo() -> Any:
                    return dist.ProcessGroupGloo(prefix, rank, world_size, opts)

                # Its rendezvous waits on the store: a worker's, on a trainer that may be frozen.
                pg = gloo() if rank == 0 else trainer_store_call(gloo, "the gloo rendezvous", timeout_s=timeout_s)
        except (RuntimeError, OSError) as e:
            raise WeightTransferError(
                f"the transfer group of world_size={world_size} did not form within timeout_s={timeout_s:g} "
                f"(this is rank {rank}): {e}. world_size must be 1 + all inference workers of all servers"
            ) from e
        shm = None
        step = "session check"
        try:
            if session_id is not None:
                check_peers(pg, session_id=session_id, rank=rank, world_size=world_size, device=device)
            step = "shared-memory ring negotiation"
            if transport == "shm" and rank == 0:
                shm = offer_ring(prefix, world_size=world_size, timeout_s=timeout_s, fallback_to_gloo=fallback_to_gloo)
            elif transport == "shm":
                shm = join_ring(prefix, rank=rank, world_size=world_size, timeout_s=timeout_s)
        except BaseException as e:
            cls(prefix, pg, rank, world_size, device, timeout_s=timeout_s).destroy()
            if isinstance(e, WeightTransferError) or not isinstance(e, Exception):
                raise
            raise WeightTransferError(
                f"the {step} of the transfer group did not finish within timeout_s={timeout_s:g} "
                f"(this is rank {rank}; did a rank die?): {e}"
            ) from e
        group = cls(prefix, pg, rank, world_size, device, shm, timeout_s=timeout_s)
        if rank != 0:
            group._open_signals(master_address, store, session_id)
        return group

    def _open_signals(self, master_address: str, store: dist.Store, session_id: str | None) -> None:
        """A worker: its client for ``signal_staged``, and its count in the
        workers that signal. Best effort: without it the trainer does not
        wait for this group's stagings, and pauses as soon as it sent."""
        try:
            client = open_store(master_address, store.port, self.world_size, is_master=False, timeout_s=self.timeout_s)
            signals = dist.PrefixStore(store_prefix(session_id), client)
            trainer_store_call(lambda: signals.add(_STAGED_SIGNAL_KEY, 1), "the trainer's store", timeout_s=self.timeout_s)
            self._signals = signals
        except Exception:  # noqa: BLE001 - an optimisation of the pause, never a failed join
            logger.debug("torch_dist: no staging signal to the trainer", exc_info=True)

    def signal_staged(self) -> None:
        """A worker: a staged update of this group ended receiving (whole,
        or failed: the commit then says which). Best effort, bounded."""
        signals = self._signals
        if signals is None:
            return
        try:
            trainer_store_call(lambda: signals.add(_STAGED_KEY, 1), "the trainer's store", timeout_s=CLEANUP_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the trainer pauses at its bound instead
            self._signals = None
            logger.debug("torch_dist: could not signal the end of a staging", exc_info=True)

    def wait_staged(self, *, within_s: float) -> bool | None:
        """Rank 0, a staged round streamed: wait until every worker ended
        receiving it (at most ``within_s``: ``False``). ``None`` when some
        worker does not signal (a server older than the signal). A worker
        lags the trainer by what its receive buffers hold (on this machine
        0.05-0.09 s for 74M): pausing generation for the commit before it
        ended would stop it for that too."""
        assert self.store is not None
        self._staged_rounds += 1
        if int(self.store.add(_STAGED_SIGNAL_KEY, 0)) < self.world_size - 1:
            return None
        deadline = time.monotonic() + within_s
        while int(self.store.add(_STAGED_KEY, 0)) < self._staged_rounds * (self.world_size - 1):
            if time.monotonic() > deadline:
                return False
            time.sleep(STAGED_POLL_S)
        return True

    def broadcast(self, tensor: torch.Tensor) -> Any:
        if self.shm is not None:
            return self.shm.broadcast(tensor)
        while self._in_flight and self._in_flight[0].is_completed():
            self._in_flight.popleft()
        work = self.pg.broadcast(tensor, 0)
        self._in_flight.append(work)
        return work

    @property
    def broadcast_parts(self) -> Callable[[list[torch.Tensor]], Any] | None:
        """Broadcast several tensors as one message (what the receivers get is
        their concatenation), or None when the transport cannot: only the
        ring can, and it lets the sender skip the pack copy."""
        return self.shm.broadcast_parts if self.shm is not None else None

    def keep_store_server(self, server: dist.TCPStore) -> None:
        """Keep the trainer's store server for the group's life (the workers
        ask it whether the trainer left); ``destroy`` closes it."""
        self._store_server = server

    def wait_received(self, work: Any) -> None:
        """A worker's wait for one broadcast of the trainer.

        gloo's ``abort`` does not reach the peers (torch 2.13: a rank blocked
        in a collective with a rank that aborted waits out its whole timeout,
        and its own ``abort`` does not wake it either), so a worker waits in
        slices of ``WAIT_SLICE`` and between them asks the trainer's store
        whether the trainer left: a round the trainer gave up (another server
        failed, a trainer rank died) frees this server at once, not at
        ``timeout_s``. The broadcast itself fails at the group's
        ``timeout_s``, which gloo keeps against a frozen trainer too: that is
        what bounds the wait when the store does not answer. The ring has its
        own abort flag; NCCL waits as it did.
        """
        if self.transport != "gloo":
            work.wait()
            return
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError:
                if work.is_completed():
                    # It failed, or completed just after the slice ran out
                    # (the slice's "Operation timed out!" is then no failure
                    # of it): waiting on a completed work gives its own outcome.
                    work.wait()
                    return
            if self._trainer_left():
                raise WeightTransferError("the trainer left the transfer group in the middle of a broadcast")

    def _trainer_left(self) -> bool:
        """What the last question to the store answered; asks the next one.

        Asked on a thread and never waited for: ``check`` waits with no time
        limit when the trainer is frozen (``waits``). An answer that is late
        (a loaded machine) is not "left", only not known yet; a question
        unanswered is not asked again (the store takes one call at a time).
        """
        store = self.store
        if store is None:
            return True
        asked = self._left_asked
        if asked is not None:
            if not asked.done():
                return False
            # An error: the store went away with the trainer.
            if asked.exception() is not None or asked.result():
                return True
        self._left_asked = in_daemon_thread(lambda: store.check([_TRAINER_LEFT_KEY]), "wt-trainer-left")
        return False

    def trainer_still_there(self, *, within_s: float) -> bool:
        """A worker's check before it commits a staged round: the trainer has
        not left the group (``destroy``), asked of its store now. No answer
        within ``within_s``, or none at all (the store went away with the
        trainer), counts as gone: a round is committed only on a yes."""
        store = self.store
        if store is None:
            return False
        try:
            return not trainer_store_call(lambda: store.check([_TRAINER_LEFT_KEY]), "the trainer's store", timeout_s=within_s)
        except Exception:  # noqa: BLE001 - whatever went wrong, no yes
            return False

    def destroy(self) -> None:
        if self.rank == 0 and self.store is not None:
            try:
                self.store.set(_TRAINER_LEFT_KEY, "1")
            except Exception:  # noqa: BLE001 - best effort, as below
                logger.debug("could not tell the workers that the trainer leaves", exc_info=True)
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        pg, self.pg, self.store, self._store_server = self.pg, None, None, None
        if pg is not None:
            # Freeing a gloo group joins its threads, which wait until the
            # group's pending operations (a broadcast to a peer that stopped
            # reading, receives posted ahead) end: up to timeout_s, and
            # ``abort`` does not end them sooner. With none pending the group
            # is freed here, at once. Otherwise a thread of its own holds it
            # until they ended, so whoever drops it last does not wait, and
            # the interpreter waits for that thread at exit: a process that
            # ended with the group's threads still running was killed by
            # std::terminate (exit 134) after a successful run.
            works = [w for w in self._in_flight if not w.is_completed()]
            self._in_flight = deque()
            if works:
                release = threading.Thread(target=_release, args=(pg, works), name="wt-release-group", daemon=True)
                release.start()
                # A thread frees the group when its run() returns, after
                # _release: until then it is alive, and waited for.
                wait_at_exit(release, self.timeout_s + _RELEASE_SLACK_S)


_AT_EXIT: list[tuple[threading.Thread | Future, float]] = []
"""Threads (or futures of threads) in torch.distributed's C++ code, with the time by which they end."""
_AT_EXIT_LOCK = threading.Lock()
_RELEASE_SLACK_S = 5.0


def _running(task: threading.Thread | Future) -> bool:
    return not task.done() if isinstance(task, Future) else task.is_alive()


def wait_at_exit(task: threading.Thread | Future, within_s: float) -> None:
    """Make the interpreter's exit wait, at most ``within_s`` from now, for
    ``task``: a daemon thread that may still be in torch.distributed's C++
    code (a group being freed, a join given up on). A daemon thread still
    there when the interpreter finalizes is ended by unwinding its stack
    through C++ frames that do not allow it: the process aborts in
    std::terminate ("terminate called without an active exception", exit
    134) instead of exiting with its own status, a Python error's 1 included."""
    with _AT_EXIT_LOCK:
        _AT_EXIT[:] = [(t, d) for t, d in _AT_EXIT if _running(t)]
        _AT_EXIT.append((task, time.monotonic() + within_s))


def _release(pg: Any, works: list[Any]) -> None:
    for work in works:
        try:
            work.wait()
        except Exception:  # noqa: BLE001 - a failed or timed-out operation has ended too
            pass
    del pg


@atexit.register
def _wait_at_exit() -> None:
    with _AT_EXIT_LOCK:
        pending = list(_AT_EXIT)
    for task, deadline in pending:
        left = max(0.0, deadline - time.monotonic())
        if isinstance(task, Future):
            futures_wait([task], timeout=left)
        else:
            task.join(timeout=left)
