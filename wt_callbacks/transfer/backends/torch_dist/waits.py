"""Bounded waits of a ``torch_dist`` round: broadcasts polled, watching the server calls;
a worker's calls to the trainer's store, on a thread.

While the trainer broadcasts, the servers' ``init_weight_transfer_engine`` /
``update_weights`` HTTP calls are in flight on other threads
(``base.in_daemon_thread``); every wait here also watches that call, so a
server that refuses fails the round at once instead of at ``timeout_s``.

A worker's rendezvous store is a client of the trainer's ``TCPStore``, whose
calls (connect, get, wait, check, add: all but ``set``) wait for the answer
with no time limit when the trainer's process is frozen (SIGSTOP, a host
whose network dropped without closing the connection): the store's own
timeout is not kept then (torch 2.13). ``trainer_store_call`` bounds them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from wt_callbacks.transfer.base import WeightTransferError, bounded

STORE_SLACK_S = 2.0
"""How long past ``timeout_s`` a worker waits for a call to the trainer's
store: a trainer that answers at all ends the call sooner, with its answer or
the store's own timeout error (which says what it waited for)."""


def raise_if_failed(future: Future | None, what: str) -> None:
    if future is not None and future.done() and future.exception() is not None:
        raise WeightTransferError(f"{what} failed on the server: {future.exception()}") from future.exception()


def wait_for_work(work: Any, *, timeout_s: float, server_call: Future | None = None) -> None:
    """Wait for a collective, checking the concurrent server call meanwhile.

    A server that rejects the update (unknown name, wrong shape) answers its
    HTTP call with an error and stops receiving; polling that call turns what
    would be a wait until the timeout into an immediate, explicit error.
    """
    deadline = time.monotonic() + timeout_s
    pause = 5e-5
    while not work.is_completed():
        raise_if_failed(server_call, "update_weights")
        if time.monotonic() > deadline:
            raise WeightTransferError(f"broadcast did not complete within timeout_s={timeout_s:g}")
        time.sleep(pause)
        pause = min(pause * 2, 5e-3)
    try:
        work.wait()
    except RuntimeError as e:
        # A server that refused the update leaves the group, so our broadcast
        # fails too; its own answer says why, the socket error does not. It
        # answers at once; a frozen one never does, and timeout_s bounds the
        # wait for it too.
        if server_call is not None:
            try:
                server_error = server_call.exception(timeout=min(5.0, max(deadline - time.monotonic(), 0.1)))
            except FutureTimeout:
                server_error = None
            if server_error is not None:
                raise WeightTransferError(f"update_weights failed on the server: {server_error}") from e
        raise WeightTransferError(f"broadcast to the servers failed (did a server crash?): {e}") from e


def trainer_store_call(fn: Callable[[], Any], what: str, *, timeout_s: float) -> Any:
    """``fn()``, a worker's call to the trainer's store, given up past
    ``timeout_s`` + ``STORE_SLACK_S`` (``WeightTransferError``). A call given
    up stays blocked on its thread until the trainer answers or dies; its
    store must not be used again (``TCPStore`` clients take one call at a
    time), so a caller that gives up leaves the group."""
    return bounded(fn, what, within_s=timeout_s + STORE_SLACK_S, peer="trainer")
