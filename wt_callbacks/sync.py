"""``WeightSync``: the framework-free driver of weight-sync rounds.

It turns a ``SyncConfig`` into a weight source, a control-plane client and a
trainer engine, decides when a round is due, runs the round on every trainer
rank and reports metrics. The Lightning callback and the Accelerate hook are
thin translations of their framework's events into these calls::

    ws = WeightSync(SyncConfig.from_hparams(hparams))
    ws.setup(model, rank, world_size, collectives=...)   # fit start, every rank
    ws.sync_at_fit_start(step)
    ws.maybe_sync(step)                                   # after each optimizer step
    ws.maybe_sync(step, epoch_end=True)                   # at each epoch end
    ws.sync_at_train_end(step)
    ws.close()

Metrics: ``SyncResult.metrics()`` once per successful round (an event, logged
at the step it happened; ``WeightSync.take_results()`` hands out each round
once, also the rounds ``send: async`` collects later) and
``WeightSync.gauges(step)`` (failed rounds so far, how far the servers lag),
which the adapters log on their framework's own logging cadence.

Trainer ranks agree through ``Collectives``, two callables the framework
adapter builds from its own distributed plumbing, so this module imports no
training framework. Only trainer rank 0 talks to the servers; every rank
iterates the source (FSDP gathers are collectives). Under ``send: async``
the round after the gathers runs on a thread of rank 0 (``async_send``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from wt_callbacks.async_send import AsyncSends
from wt_callbacks.collectives import Agreement, Collectives, trainer_ranks
from wt_callbacks.config import SyncConfig
from wt_callbacks.connection import RankZeroOnly
from wt_callbacks.results import SyncResult
from wt_callbacks.rounds import RoundRunner
from wt_callbacks.transfer.base import VLLMWeightSyncClient
from wt_callbacks.transfer.sources import ModuleSource
from wt_callbacks.verify import Verifier

__all__ = ["Collectives", "SyncResult", "WeightSync", "trainer_ranks"]

logger = logging.getLogger(__name__)

STATE_KEYS = ("syncs_completed", "failures", "skipped", "last_synced_step", "last_sync_time", "epochs_completed")
"""What ``state_dict`` holds: the counters a checkpoint keeps."""


class WeightSync(RoundRunner):
    """Keeps inference servers on the trainer's weights; one instance per trainer rank.

    Args:
        config: what to send, where and when.
        client: a ready ``VLLMWeightSyncClient`` used on every rank instead of
            one built from ``config.servers`` / ``config.ray_actors`` (which is
            built on rank 0 only; ``ray_actors`` needs ``ray.init()`` there).
        log: where trainer rank 0 writes ``SyncResult.summary()`` after each
            successful round (default: this module's logger, at INFO); a
            framework adapter passes its framework's, so the line appears
            with the framework's own output.

    How a round runs, agrees across ranks and fails is ``RoundRunner``'s
    (``rounds``). Under ``send: async`` a round's outcome is agreed on where
    the ranks meet next (``async_send``).
    """

    def __init__(
        self,
        config: SyncConfig,
        *,
        client: VLLMWeightSyncClient | None = None,
        log: Callable[[str], None] = logger.info,
    ) -> None:
        super().__init__(config, client=client, log=log)
        self.epochs_completed = 0
        self._last_attempt = time.monotonic()
        self._last_time_check_step: int | None = None
        self._last_attempted_step: int | None = None
        self._verifier: Verifier | None = None
        self._async: AsyncSends | None = None

    # -- lifecycle -----------------------------------------------------------

    def setup(
        self, module: torch.nn.Module, rank: int = 0, world_size: int = 1, *, collectives: Collectives | None = None
    ) -> None:
        """Build source, client and engine; call on every trainer rank at fit start.

        Connecting to the servers follows ``on_error``: under ``"warn"`` a
        server that is not up yet is retried at the first due round.
        Mistakes in ``module`` / ``include`` / ``exclude`` / ``servers``
        always raise ``ValueError``, as does a ``send: async`` snapshot that
        does not fit in the host memory available (naming the bytes it needs).
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in 0..world_size-1 (world_size={world_size})")
        if world_size > 1 and collectives is None:
            raise ValueError(
                f"world_size={world_size}: pass collectives= built from the framework's strategy "
                "(see Collectives), or Collectives.from_torch_distributed()"
            )
        self.close()
        self.rank, self.world_size, self.collectives = rank, world_size, collectives
        self._agreement = Agreement(rank, world_size, collectives)
        cfg = self.config
        # The engine casts to the wire dtype (before any gather) from its config.
        if cfg.lora == "adapter":
            from wt_callbacks.lora.adapter import AdapterSource

            self.source = AdapterSource(module, submodule=cfg.module)
        else:
            self.source = ModuleSource(module, submodule=cfg.module, include=cfg.include, exclude=cfg.exclude, lora=cfg.lora)
            self.keeps_frozen = cfg.sends_frozen_once(peft_merge=self.source.lora is not None)
        self._verifier = Verifier.for_config(cfg, self.source) if cfg.verify_every_n_syncs else None
        if cfg.send == "async":
            self._async = AsyncSends(self, module)
            self.snapshot = self._async.snapshot
            self._async.check_memory()
        if self._given_client is not None:
            self.client = self._given_client
        elif rank != 0:
            self.client = RankZeroOnly()
        # Rank 0 builds its client in _connect, inside an agreed phase: a Ray
        # actor that does not exist must fail every rank, not rank 0 alone.
        self._last_attempt = time.monotonic()
        self._phase(self._connect, "connecting to the servers")

    def close(self) -> None:
        """Leave the transfer group and close a client this object built.

        Under ``send: async`` a round still in flight gets ``CLEANUP_TIMEOUT_S``
        to end; its outcome is logged (``sync_at_train_end`` collects the last
        round of a run that ended normally)."""
        if self._async is not None:
            self._async.close()
            self._async = self.snapshot = None
        self._drop_engine()
        close = getattr(self.client, "close", None)
        if self.client is not self._given_client and callable(close):
            close()
        self.client = None
        self.source = None
        self.keeps_frozen, self._frozen_held = False, None

    # -- cadence -------------------------------------------------------------

    def maybe_sync(
        self, step: int, *, epoch_end: bool = False, epochs_done: int | None = None, now: float | None = None
    ) -> bool:
        """Run a round if the configured cadence says so; ``True`` if one ran and succeeded.

        Call on every rank after each optimizer step with the number of
        optimizer steps done (calls repeating a step, as with gradient
        accumulation, are ignored), and with ``epoch_end=True`` at each epoch
        end. ``epochs_done`` is the framework's own count of finished epochs
        there (Lightning's ``current_epoch + 1``): a run resumed from a
        checkpoint written without this state, or a driver reused for
        another run, then keeps the framework's epoch cadence; without it the
        epoch ends are counted here. ``train_time_interval`` is decided on rank 0 from ``now``
        (``time.monotonic()`` seconds; default: now) and broadcast, so every
        rank takes the same decision. A step already on the servers is never
        sent again. Under ``send: async``, ``True`` means the round before
        this one was collected here and succeeded (``last_result`` is that
        round's); this one runs in the background.
        """
        key, every = self.config.trigger
        if epoch_end:
            self.epochs_completed = self.epochs_completed + 1 if epochs_done is None else epochs_done
            due = key == "every_n_epochs" and every > 0 and self.epochs_completed % every == 0
        elif key == "every_n_train_steps":
            due = every > 0 and step > 0 and step % every == 0
        elif key == "train_time_interval" and step != self._last_time_check_step:
            self._last_time_check_step = step
            due = self._time_due(every, now)
        else:
            due = False
        if not due or step in (self.last_synced_step, self._last_attempted_step):
            return False
        # Remembered before the round: calls repeating this step (gradient
        # accumulation) must not retry a failed round once per micro-batch.
        self._last_attempted_step = step
        return self.sync(step, now=now) is not None

    def sync_at_fit_start(self, step: int) -> SyncResult | None:
        """Cold sync if ``sync_on_fit_start``, also after a resume: a restarted
        server may hold anything, whatever the restored state says. It
        returns once the servers hold the weights, under ``send: async`` too."""
        return self._sync(step, await_round=True) if self.config.sync_on_fit_start else None

    def sync_at_train_end(self, step: int) -> SyncResult | None:
        """Final sync if ``sync_on_train_end`` and ``step`` is not on the servers
        yet; it returns once the servers hold the weights. Under ``send:
        async`` the round still in flight is collected first, whatever
        ``sync_on_train_end`` says; its result is returned when no final
        round follows."""
        collected = self._async.collect(step) if self._async is not None else None
        if self.config.sync_on_train_end and step != self.last_synced_step:
            return self._sync(step, await_round=True)
        return collected

    def _time_due(self, interval: float, now: float | None) -> bool:
        due = self.rank == 0 and (time.monotonic() if now is None else now) - self._last_attempt >= interval
        if self.world_size > 1:
            assert self.collectives is not None
            due = bool(self.collectives.broadcast(due))
        return due

    # -- the round -----------------------------------------------------------

    def sync(
        self, step: int, version: str | None = None, *, now: float | None = None, verify: bool = False
    ) -> SyncResult | None:
        """One round on every rank (DESIGN.md "One sync round").

        Returns the round's metrics, or ``None`` when it failed under
        ``on_error="warn"``. ``version`` defaults to ``f"step-{step}"``;
        ``now`` (``time.monotonic()`` seconds, default: now) restarts the
        ``train_time_interval`` clock, in the clock ``maybe_sync`` was given.
        ``verify`` checks what the servers serve after this round, whatever
        ``verify_every_n_syncs`` says (see ``wt_callbacks.verify``); a check
        beyond the tolerance fails the round.

        Under ``send: async`` the round runs in the background and this
        returns the metrics of the round before it, collected here (``None``
        when there was none, it failed under ``"warn"``, or this round was
        skipped under ``async_overflow: skip``); with ``verify`` it waits for
        this round and returns its own.
        """
        return self._sync(step, version, now=now, verify=verify, await_round=verify)

    def _sync(
        self, step: int, version: str | None = None, *, now: float | None = None, verify: bool = False,
        await_round: bool,
    ) -> SyncResult | None:  # fmt: skip
        if self.source is None:
            raise RuntimeError("call setup(module, rank, world_size) before sync()")
        version = f"step-{step}" if version is None else version
        # An attempt, failed or not, restarts the interval: a dead server is
        # retried once per interval, not at every step.
        self._last_attempt = time.monotonic() if now is None else now
        verifier = self._verifier_for(verify)
        if self._async is not None:
            return self._async.round(step, version, await_round=await_round, verifier=verifier)
        return self._blocking_round(step, version, verifier)

    def _verifier_for(self, asked: bool) -> Verifier | None:
        """The verifier if this round is checked: asked for, or every
        ``verify_every_n_syncs``-th successful round (this one counted)."""
        every = self.config.verify_every_n_syncs
        if not asked and not (every and (self.syncs_completed + 1) % every == 0):
            return None
        if self._verifier is None:
            assert self.source is not None
            self._verifier = Verifier.for_config(self.config, self.source)
        return self._verifier

    # -- gauges --------------------------------------------------------------

    def gauges(self, step: int, prefix: str = "weight_sync/") -> dict[str, float]:
        """Values that change between rounds, for the framework's logging cadence.

        ``failures``: rounds that failed so far (a round that had to connect
        first counts once; the connect in ``setup`` is no round).
        ``steps_behind``: optimizer steps between ``step`` and the step the
        servers serve (acknowledged: under ``send: async`` a round in flight
        does not count until it is collected); absent until a round
        succeeded. ``skipped`` (``send: async`` only): due rounds skipped
        because one was still in flight (``async_overflow: skip``).
        """
        gauges = {f"{prefix}failures": float(self.failures)}
        if self.config.send == "async":
            gauges[f"{prefix}skipped"] = float(self.skipped)
        if self.last_synced_step is not None:
            gauges[f"{prefix}steps_behind"] = float(step - self.last_synced_step)
        return gauges

    # -- resume state --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: rounds done, failed and skipped, last synced
        step and wall-clock time, epochs seen.

        Only steps the servers acknowledged: under ``send: async``, trainer
        rank 0 (whose state a checkpoint keeps) first waits for a round in
        flight and counts its outcome here, without applying ``on_error``,
        which the next point where the ranks meet does. No collective: a
        framework may ask rank 0 alone."""
        state = {key: getattr(self, key) for key in STATE_KEYS}
        if self._async is not None:
            state.update(self._async.settled_counters())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``; keys it lacks keep their current value."""
        unknown = set(state) - set(STATE_KEYS)
        if unknown:
            raise ValueError(f"weight sync state: unknown keys {sorted(unknown)}")
        for key, value in state.items():
            setattr(self, key, value)
