"""``GenerationPause``: trainer rank 0 pauses the servers' generation around a round, and times it."""

from __future__ import annotations

import logging
import time
from typing import Any

from wt_callbacks.config import SyncConfig
from wt_callbacks.transfer.base import CLEANUP_TIMEOUT_S, best_effort, bounded

logger = logging.getLogger(__name__)


class GenerationPause:
    """``/pause`` and ``/resume`` of one round, as ``pause`` (the config's mode) says.

    ``call_seconds`` is the last round's ``/pause`` call, ``paused_seconds``
    the time generation stood still: from that call to the ``/resume``
    answer. A round that failed resumes ``quietly``: the failure is logged,
    never raised over the round's own error, and waited for at most
    ``CLEANUP_TIMEOUT_S``, so the servers are never left paused by a round
    of ours, whatever happened.
    """

    def __init__(self, config: SyncConfig) -> None:
        self.config = config
        self.paused = False
        self.call_seconds = 0.0
        self.paused_seconds = 0.0
        self._since = 0.0

    def can_pause(self, client: Any) -> bool:
        return self.config.pause_mode is not None and callable(getattr(client, "pause", None))

    def reset(self) -> None:
        """A new round: no pause yet."""
        self.call_seconds = self.paused_seconds = 0.0

    def pause(self, client: Any) -> None:
        if not self.can_pause(client):
            return
        self.paused = True
        self._since = time.perf_counter()
        bounded(lambda: client.pause(self.config.pause_mode), "pause", within_s=self.config.timeout_s)
        self.call_seconds = time.perf_counter() - self._since

    def resume(self, client: Any, *, quiet: bool = False) -> None:
        """Resume servers this round paused (a no-op otherwise)."""
        if not self.paused:
            return
        if not quiet:
            # A failure leaves ``paused`` set: the quiet retry follows.
            bounded(client.resume, "resume", within_s=self.config.timeout_s)
            self.paused = False
            self.paused_seconds = time.perf_counter() - self._since
            return
        self.paused = False
        error = best_effort(client.resume, "resume", within_s=min(self.config.timeout_s, CLEANUP_TIMEOUT_S))
        if error is not None:
            logger.warning("could not resume the servers after a failed round: %s", error)
