"""``RoundRunner``: how one weight-sync round runs on every trainer rank, and what it counts.

``WeightSync`` (``sync``) decides when a round runs and keeps the resume
state; this base holds the round's mechanics, which ``send: blocking`` and
``send: async`` (``async_send``) share: rank 0 connects if it has to, pauses
the servers, sends, resumes them; every rank agrees on each phase's outcome,
applies ``on_error`` to a failure alike, and counts a round the servers
acknowledged.

Trainer ranks agree through ``Collectives`` (``collectives``). Only trainer
rank 0 talks to the servers; every rank iterates the source (FSDP gathers are
collectives). Under ``send: async`` rank 0 alone sends, from its host
snapshot: the other ranks need no engine.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from wt_callbacks.collectives import Agreement, Collectives, describe
from wt_callbacks.config import SyncConfig
from wt_callbacks.connection import build_client
from wt_callbacks.pausing import GenerationPause
from wt_callbacks.results import SyncResult
from wt_callbacks.transfer.base import TrainerWeightTransferEngine, VLLMWeightSyncClient, WeightSource, WeightTransferError
from wt_callbacks.transfer.factory import WeightTransferTrainerFactory
from wt_callbacks.transfer.sources import ModuleSource
from wt_callbacks.transfer.sources.snapshot import HostSnapshot
from wt_callbacks.verify import Verifier

logger = logging.getLogger("wt_callbacks.sync")
"""The driver's logger (``wt_callbacks.sync``): where failed rounds are warned about."""

UNREPORTED_KEPT = 64
"""Results ``take_results`` hands out at most: older ones not taken are dropped."""


class RoundRunner:
    """The round's mechanics and counters of one trainer rank (see the module docstring).

    A failed round never deadlocks the ranks: every phase ends with an
    agreement, so all ranks take the same branch. With ``on_error="raise"``
    every rank raises ``WeightTransferError`` naming the failure; with
    ``"warn"`` every rank logs, drops the engine (its group is out of step)
    and reconnects at the next due round.
    """

    def __init__(
        self, config: SyncConfig, *, client: VLLMWeightSyncClient | None, log: Callable[[str], None]
    ) -> None:
        self.config = config
        self._given_client = client
        self._log = log
        self.client: Any = None
        self.source: ModuleSource | None = None
        self.snapshot: HostSnapshot | None = None
        """``send: async``: the host snapshot trainer rank 0 sends from."""
        self.engine: TrainerWeightTransferEngine | None = None
        self.rank = 0
        self.world_size = 1
        self.collectives: Collectives | None = None
        self._agreement = Agreement()
        self.last_result: SyncResult | None = None
        self._unreported: deque[SyncResult] = deque(maxlen=UNREPORTED_KEPT)
        self.syncs_completed = 0
        self.failures = 0
        self.skipped = 0
        self.last_synced_step: int | None = None
        self.last_sync_time: float | None = None
        self.pausing = GenerationPause(config)
        """Rank 0's pause of the servers around a round, and its timing."""
        self.keeps_frozen = False
        """``send_frozen: once`` in force for this source (set at setup)."""
        self._frozen_held: frozenset[str] | None = None
        """The frozen tensors the servers of this connection hold from its
        rounds, as of the last one acknowledged; ``None``: no round
        acknowledged since the connection formed, so the next sends all."""
        self._round_frozen: frozenset[str] = frozenset()

    # -- a round under send: blocking -----------------------------------------

    def _blocking_round(self, step: int, version: str, verifier: Verifier | None) -> SyncResult | None:
        """The whole round on every rank; its result, or ``None`` if it failed under ``"warn"``."""
        start = time.perf_counter()
        verify_diff: float | None = None
        what = f"round for step {step} (version {version!r})"
        self.pausing.reset()
        try:
            with self.leaving_frozen():
                ok = self._phase(self._begin, what) and self._phase(lambda: self._send(version), what)
            if ok and verifier is not None:
                ok, verify_diff = self._verify(verifier, what)
        finally:
            # A no-op unless the round failed before send() resumed: the
            # servers are never left paused, whatever happened.
            self._resume(quiet=True)
        if not ok:
            self.failures += 1
            return None
        seconds = time.perf_counter() - start
        result = SyncResult(
            version=version, step=step, seconds=seconds, syncs_completed=self.syncs_completed + 1,
            verify_max_logprob_diff=verify_diff, stall_seconds=seconds, **self._round_figures(),
        )  # fmt: skip
        self._acknowledged(result)
        return result

    @contextlib.contextmanager
    def leaving_frozen(self) -> Iterator[None]:
        """Around a round's pass, on every rank (``send_frozen: once``): the
        source leaves out the frozen tensors the servers already hold, those
        frozen now that were frozen at the connection's last acknowledged
        round too (a parameter frozen since then may have trained after it
        was sent). Every rank reads the same ``requires_grad`` and the same
        agreed outcomes, so every rank leaves out the same gathers."""
        if not self.keeps_frozen:
            yield
            return
        assert isinstance(self.source, ModuleSource)
        self._round_frozen = self.source.frozen_names()
        held = self._frozen_held
        self.source.keep(self._round_frozen & held if held is not None else ())
        try:
            yield
        finally:
            self.source.keep(())

    # -- the steps of a round (rank 0's thread runs them under send: async) ---

    def _begin(self) -> None:
        """Connect if the engine was dropped; pause generation unless the round is staged."""
        if self.engine is None:
            self._connect()
        if self.config.commit == "inline":
            self._pause()

    def _send(self, version: str, *, awaited: bool = True) -> None:
        """Every rank: the engine's round, then (rank 0) generation resumed.
        Under ``commit: staged`` (and ``prepared``) generation is paused only
        once the servers staged the whole round, right before its commit;
        ``awaited``: whether the training loop waits for this round (which
        sets the servers' default ``staging_nice``)."""
        assert self.engine is not None
        if self.config.commit != "inline" and self.rank == 0:
            self.engine.send_weights(
                version, commit_gate=self._pause, prepared=self.config.commit == "prepared",
                staging_nice=self.config.staging_niceness(awaited=awaited),
            )  # fmt: skip
        else:
            self.engine.send_weights(version)
        self._resume()  # before the agreement: generation restarts while the ranks agree

    def _round_figures(self) -> dict[str, Any]:
        """The ``SyncResult`` fields the engine and the pause measured in the round just sent."""
        assert self.engine is not None
        stats = self.engine.last_stats
        return {
            "gather_seconds": stats.gather_seconds,
            "transfer_seconds": max(stats.seconds - stats.gather_seconds, 0.0),
            "bytes": stats.bytes,
            "gbps": stats.bytes / 1e9 / stats.seconds if stats.seconds > 0 else 0.0,
            "pause_seconds": self.pausing.call_seconds,
            "generation_paused_seconds": self.pausing.paused_seconds,
        }

    def _pause(self) -> None:
        """Rank 0: pause generation on every server, if configured."""
        if self.rank == 0:
            self.pausing.pause(self.client)

    def _resume(self, *, quiet: bool = False) -> None:
        self.pausing.resume(self.client, quiet=quiet)

    def _verify(self, verifier: Verifier, what: str) -> tuple[bool, float | None]:
        """Every rank: ``verifier``'s check of the round ``what`` as a phase
        (agreed, ``on_error`` applied); whether it passed, and its difference."""
        diff: float | None = None

        def check() -> None:
            nonlocal diff
            diff = verifier.check(self.rank, self.world_size, self.collectives)

        return self._phase(check, f"verification of {what}"), diff

    def _connect(self) -> None:
        assert self.source is not None
        cfg = self.config
        if self.snapshot is not None and self.rank != 0:
            return  # only rank 0 sends, from its snapshot: the other ranks need no engine
        if self.client is None:
            self.client = build_client(cfg)
        source: WeightSource = self.source if self.snapshot is None else self.snapshot
        self.engine = WeightTransferTrainerFactory.trainer_init(
            cfg.backend,
            cfg.backend_config(),
            cfg.init_info_for(self.rank),
            client=self._adapter_serving() if cfg.lora == "adapter" and self.rank == 0 else self.client,
            source=source,
        )

    def _adapter_serving(self) -> VLLMWeightSyncClient:
        """``lora: adapter``: the client that has the servers load each round's
        adapter, once they said they can serve it (before any rendezvous)."""
        from wt_callbacks.lora.adapter import AdapterServingClient

        assert self.source is not None
        serving = AdapterServingClient(self.client, self.config.lora_name, self.source, moe=self.source.layout.moe)
        serving.check_servers()
        return serving

    def _drop_engine(self) -> None:
        if self.engine is None:
            return
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - a broken group must not block the reconnect
            logger.warning("weight sync engine shutdown failed", exc_info=True)
        self.engine = None

    # -- agreement, failure, success -------------------------------------------

    def _phase(self, fn: Callable[[], None], what: str) -> bool:
        """Run ``fn`` on this rank, agree across ranks, apply ``on_error`` to a
        failure anywhere; ``True`` if every rank succeeded."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every failure must reach the agreement
            # Handled inside the except block so the exception is never stored
            # in a local: that would form a cycle (exception -> traceback ->
            # frame -> local) keeping the failed engine's sockets, and a fixed
            # master_port, busy until the garbage collector runs.
            self._fail(what, self._agreement.agree(describe(e)), e)
            return False
        error = self._agreement.agree(None)
        if error is not None:
            self._fail(what, error, None)
            return False
        return True

    def _fail(self, what: str, error: str | None, exc: Exception | None = None) -> None:
        """Apply ``on_error`` to a failed round (``error``: where and why), on every rank alike."""
        self._drop_engine()
        self._frozen_held = None  # the next connection's servers may hold anything
        message = f"weight sync {what} failed on {error}"
        if self.config.on_error == "raise":
            raise WeightTransferError(
                f"{message}. Set on_error: warn to keep training through server outages"
            ) from exc
        logger.warning("%s; training continues, reconnecting at the next due round", message)

    def _acknowledged(self, result: SyncResult, *, at: float | None = None) -> None:
        """Count a round the servers acknowledged (``at``: when, ``time.time()``), on every rank alike."""
        self.syncs_completed = result.syncs_completed
        if self.keeps_frozen:
            if self._frozen_held is None and self._round_frozen and self.rank == 0:
                logger.info(
                    "weight sync: the servers hold %d frozen tensors now; later rounds leave them out (send_frozen: once)",
                    len(self._round_frozen),
                )  # fmt: skip
            self._frozen_held = self._round_frozen
        self.last_synced_step = result.step
        self.last_sync_time = time.time() if at is None else at
        self.last_result = result
        self._unreported.append(result)
        if self.rank == 0:
            self._log(result.summary())

    def take_results(self) -> list[SyncResult]:
        """The rounds acknowledged since the last call, oldest first (on every
        rank): what a framework adapter logs, one row each. Under ``send:
        async`` a round is acknowledged where it is collected, so a call can
        return two (the final sync collects the round in flight first)."""
        results = list(self._unreported)
        self._unreported.clear()
        return results
