"""``send: async``: rounds sent from a host snapshot by a background thread of trainer rank 0.

A due round stalls the training loop only while every rank takes the
snapshot (``HostSnapshot.capture``: the gathers, in lockstep as always, and
rank 0's copy into host memory). Rank 0's thread then runs the rest of the
round from the snapshot (connect if needed, pause, start, update, finish,
resume) while training goes on; the parameters may change meanwhile, the
snapshot does not. The thread calls no collective of the trainer's: its
transfer group is its own (``torch_dist``: a stateless group and HTTP), so a
server that dies or hangs cannot hang the other ranks, which never wait for
the thread.

At most one round is in flight: a round that comes due while one is, waits
for it (``async_overflow: wait``; the wait counts as stall) or is skipped and
counted (``skip``). The outcome of a round is collected where all ranks meet
next: the next due round, ``sync_now``, ``sync_at_train_end``. Rank 0 shares
it with the others (one broadcast), and every rank counts it, or applies
``on_error`` to it naming its step and the step it was detected at. A
checkpoint (``state_dict``) never records a step the servers have not
acknowledged, and ``close`` gives a round in flight ``CLEANUP_TIMEOUT_S``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from wt_callbacks.collectives import describe
from wt_callbacks.results import SyncResult
from wt_callbacks.transfer.base import CLEANUP_TIMEOUT_S, in_daemon_thread
from wt_callbacks.transfer.factory import WeightTransferTrainerFactory
from wt_callbacks.transfer.sources.snapshot import HostSnapshot, available_host_bytes

if TYPE_CHECKING:
    from concurrent.futures import Future

    from wt_callbacks.rounds import RoundRunner
    from wt_callbacks.verify import Verifier

logger = logging.getLogger(__name__)

FIGURES = (
    "version", "step", "seconds", "gather_seconds", "transfer_seconds", "bytes", "gbps", "pause_seconds",
    "generation_paused_seconds", "snapshot_seconds", "latency_seconds",
)  # fmt: skip
"""The ``SyncResult`` fields a round's outcome carries from rank 0's thread to every rank."""
BUSY = {"busy": True}
"""What rank 0 shares when the round due now is skipped (``async_overflow: skip``)."""


class BackgroundRound:
    """One round on rank 0's thread; ``outcome()`` is its JSON result.

    ``launch``: what rank 0 measured in the training loop (step, version,
    the loop's stall, the snapshot's seconds), carried into the outcome;
    ``awaited``: whether the loop waits for this round (a cold or final sync).
    """

    def __init__(self, ws: RoundRunner, launch: dict[str, Any], started: float, *, awaited: bool) -> None:
        self.launch = launch
        self._ws = ws
        self._started = started
        self._awaited = awaited
        self._future: Future = in_daemon_thread(self._run, f"wt-round-{launch['step']}")

    def done(self) -> bool:
        return self._future.done()

    def outcome(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The outcome (``None`` if it did not end within ``timeout``)."""
        try:
            return self._future.result(timeout=timeout)
        except TimeoutError:
            return None

    def _run(self) -> dict[str, Any]:
        ws = self._ws
        ws.pausing.reset()
        start = time.perf_counter()
        try:
            ws._begin()
            ws._send(self.launch["version"], awaited=self._awaited)
        except Exception as e:  # noqa: BLE001 - the outcome carries it to every rank
            ws._resume(quiet=True)
            # The group is out of step; the next round connects again. Left
            # at once, a server still receiving fails now, not at its timeout.
            ws._drop_engine()
            return {**self.launch, "error": describe(e)}
        return {
            **ws._round_figures(),
            **self.launch,  # the gathers ran in the snapshot
            "error": None,
            "seconds": time.perf_counter() - start,
            "latency_seconds": time.perf_counter() - self._started,
            "finished_at": time.time(),
        }


class AsyncSends:
    """The ``send: async`` side of one ``WeightSync`` (every rank has one).

    Built in ``WeightSync.setup`` over its source; ``snapshot`` is what rank
    0's engine sends from. Rounds of any kind run through ``round``: the
    cold sync and the final sync (``await_round``) wait for their own round
    before they return, so the servers hold those weights when they do.
    """

    def __init__(self, ws: RoundRunner, module: torch.nn.Module) -> None:
        assert ws.source is not None
        self.ws = ws
        config = WeightTransferTrainerFactory.engine_class(ws.config.backend).parse_config(ws.config.backend_config())
        on_gpu = any(p.is_cuda for p in module.parameters())
        self.snapshot = HostSnapshot(
            ws.source.with_wire_dtype(getattr(config, "wire_dtype", None)), pin_memory=on_gpu and torch.cuda.is_available()
        )
        self.in_flight: BackgroundRound | None = None

    def check_memory(self) -> None:
        """Fail on every rank, before any round, when rank 0's snapshot does not
        fit in the host memory available now (naming the bytes it needs)."""
        error = None
        if self.ws.rank == 0:
            need, have = self.snapshot.required_bytes(), available_host_bytes()
            if have is not None and need > have:
                error = (
                    f"send: async needs a host snapshot of {need} bytes ({need / 1e9:.2f} GB: every sent tensor in "
                    f"the wire dtype) on trainer rank 0, and this host has {have} bytes ({have / 1e9:.2f} GB) "
                    "available: send fewer bytes (dtype: bfloat16, module / include / exclude) or use send: blocking"
                )
        error = self.ws._agreement.share(error)
        if error is not None:
            raise ValueError(error)

    # -- rounds ----------------------------------------------------------------

    def round(
        self, step: int, version: str, *, await_round: bool, verifier: Verifier | None
    ) -> SyncResult | None:
        """A round due now, on every rank: collect the one in flight (or skip
        this one), take the snapshot, hand the rest to rank 0's thread.

        Returns what was collected (see ``WeightSync.sync``), or with
        ``await_round`` this round's own result, verified with ``verifier``
        (``None`` if it failed under ``on_error="warn"``).
        """
        ws = self.ws
        start = time.perf_counter()
        skip = not await_round and ws.config.async_overflow == "skip"
        outcome = self._take(skip_if_busy=skip)
        if outcome == BUSY:
            ws.skipped += 1
            logger.debug("weight sync: the round for step %d is skipped: the one before is still in flight", step)
            return None
        collected = self._apply(outcome, at_step=step)
        what = f"round for step {step} (version {version!r})"
        started = time.perf_counter()
        gather_seconds = 0.0

        def take() -> None:
            nonlocal gather_seconds
            with ws.leaving_frozen():
                gather_seconds = self.snapshot.capture(is_sender=ws.rank == 0)

        if not ws._phase(take, f"snapshot of the {what}"):
            ws.failures += 1
            return None if await_round else collected
        if ws.rank == 0:
            now = time.perf_counter()
            launch = {
                "step": step, "version": version, "stall_seconds": now - start, "snapshot_seconds": now - started,
                "gather_seconds": gather_seconds,
            }  # fmt: skip
            self.in_flight = BackgroundRound(ws, launch, started, awaited=await_round)
        if not await_round:
            return collected
        outcome = self._take(skip_if_busy=False)
        verify_diff = None
        if outcome is not None and outcome["error"] is None and verifier is not None:
            verified, verify_diff = ws._verify(verifier, what)
            if not verified:
                ws.failures += 1
                return None
        stall = time.perf_counter() - start
        return self._apply(outcome, at_step=step, stall_seconds=stall, verify_diff=verify_diff)

    def collect(self, step: int) -> SyncResult | None:
        """Every rank, where they meet: wait for the round in flight and apply its outcome."""
        return self._apply(self._take(skip_if_busy=False), at_step=step)

    def _take(self, *, skip_if_busy: bool) -> dict[str, Any] | None:
        """Rank 0's round in flight, ended (waited for), shared with every
        rank; ``None`` when none was in flight, ``BUSY`` when it still runs
        and ``skip_if_busy``. Its own waits bound the wait (each ``timeout_s``)."""
        ws = self.ws
        outcome = None
        if ws.rank == 0 and self.in_flight is not None:
            if skip_if_busy and not self.in_flight.done():
                outcome = BUSY
            else:
                outcome = self.in_flight.outcome()
                self.in_flight = None
        return ws._agreement.share(outcome)

    def _apply(
        self,
        outcome: dict[str, Any] | None,
        *,
        at_step: int,
        stall_seconds: float | None = None,
        verify_diff: float | None = None,
    ) -> SyncResult | None:
        """Count a collected round or apply ``on_error`` to it, on every rank alike."""
        if outcome is None:
            return None
        ws = self.ws
        what = f"round for step {outcome['step']} (version {outcome['version']!r})"
        if outcome["error"] is not None:
            ws._fail(what, f"trainer rank 0: {outcome['error']}; detected at step {at_step}", None)
            ws.failures += 1
            return None
        fields = {name: outcome[name] for name in FIGURES}
        result = SyncResult(
            **fields, syncs_completed=ws.syncs_completed + 1, verify_max_logprob_diff=verify_diff,
            stall_seconds=outcome["stall_seconds"] if stall_seconds is None else stall_seconds,
        )  # fmt: skip
        ws._acknowledged(result, at=outcome["finished_at"])
        return result

    # -- local: a checkpoint, the end ------------------------------------------

    def settled_counters(self) -> dict[str, Any]:
        """The counters once rank 0's round in flight ended (waited for, not
        consumed: the next meeting point still applies it). Other ranks hold
        no round and report their own."""
        ws = self.ws
        if ws.rank != 0 or self.in_flight is None:
            return {}
        outcome = self.in_flight.outcome()
        assert outcome is not None
        if outcome["error"] is not None:
            return {"failures": ws.failures + 1}
        return {
            "syncs_completed": ws.syncs_completed + 1,
            "last_synced_step": outcome["step"],
            "last_sync_time": outcome["finished_at"],
        }

    def close(self) -> None:
        """Rank 0: give a round in flight ``CLEANUP_TIMEOUT_S`` and log how it ended."""
        round_, self.in_flight = self.in_flight, None
        if round_ is None:
            return
        step = round_.launch["step"]
        outcome = round_.outcome(timeout=CLEANUP_TIMEOUT_S)
        if outcome is None:
            logger.warning(
                "weight sync: the round for step %d was still in flight after %g s; leaving it", step, CLEANUP_TIMEOUT_S
            )
        elif outcome["error"] is not None:
            logger.warning("weight sync round for step %d failed on trainer rank 0: %s", step, outcome["error"])
        else:
            logger.info("weight sync round for step %d finished as training ended", step)
