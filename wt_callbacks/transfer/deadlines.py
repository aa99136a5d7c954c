"""Every wait on a peer is bounded: a server or trainer that stops answering
fails the round with a message, never hangs the training loop or its exit."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from wt_callbacks.transfer.errors import WeightTransferError

CLEANUP_TIMEOUT_S = 10.0
"""Bound on the best-effort calls after a failed round (ending a server's
update, resuming generation), at most ``timeout_s`` each: the round already
failed, and a server that stopped answering must not hold the error back by
another full ``timeout_s`` per call."""


def in_daemon_thread(fn: Callable[[], Any], name: str) -> Future:
    """Run ``fn`` on a daemon thread: a server call stuck past our timeout
    must not keep the training process alive at exit."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def bounded(fn: Callable[[], Any], what: str, *, within_s: float, peer: str = "server") -> Any:
    """``fn()``, waiting at most ``within_s`` for it (``WeightTransferError``
    past that): a config's ``timeout_s`` bounds a server call whatever
    timeout the client was built with. A call still running past the bound
    carries on in the background (its own timeout ends it, or the peer's
    death). ``peer``: who failed to answer, for the message (a worker's calls
    wait on the trainer)."""
    future = in_daemon_thread(fn, f"wt-{what}")
    try:
        # exception(), not result(): the call's own TimeoutError (a socket's)
        # is then the call's error, not "no answer".
        error = future.exception(timeout=within_s)
    except FutureTimeout:
        raise WeightTransferError(
            f"{what}: no answer within {within_s:.3g} s; not waiting for it (the {peer} is frozen or "
            "overloaded; raise timeout_s if it is just slow)"
        ) from None
    if error is not None:
        raise error
    return future.result()


def best_effort(fn: Callable[[], Any], what: str, *, within_s: float) -> Exception | None:
    """``bounded`` after a failure: returns the call's error instead of raising it."""
    try:
        bounded(fn, what, within_s=within_s)
    except Exception as e:  # noqa: BLE001 - reported to the caller, whose own error matters more
        return e
    return None
