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
at the step it happened) and ``WeightSync.gauges(step)`` (failed rounds so
far, how far the servers lag), which the adapters log on their framework's
own logging cadence.

Trainer ranks agree through ``Collectives``, two callables the framework
adapter builds from its own distributed plumbing, so this module imports no
training framework. Only trainer rank 0 talks to the servers; every rank
iterates the source (FSDP gathers are collectives).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from wt_callbacks.config import SyncConfig
from wt_callbacks.transfer.base import (
    CLEANUP_TIMEOUT_S,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightTransferError,
    best_effort,
    bounded,
)
from wt_callbacks.transfer.clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient
from wt_callbacks.transfer.factory import WeightTransferTrainerFactory
from wt_callbacks.transfer.sources import ModuleSource
from wt_callbacks.verify import Verifier

logger = logging.getLogger(__name__)


def trainer_ranks(framework_rank: int, framework_world_size: int) -> tuple[int, int]:
    """This process's trainer rank and the world size: torch.distributed's
    default group's when it is up, else what the framework reports.

    The group's count is the one ``Collectives.from_torch_distributed`` and the
    sources' gathers run over. A framework's own can differ: under DeepSpeed on
    a CPU-only machine Accelerate (and the transformers Trainer, through it)
    reports one process, index 0, on every rank while DeepSpeed runs a real
    multi-rank group, so every rank would act as the sender.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return framework_rank, framework_world_size


@dataclass(frozen=True)
class Collectives:
    """How trainer ranks agree, built by the framework adapter.

    Both are collectives: every trainer rank calls them, in the same order.
    ``WeightSync`` calls them only when ``world_size > 1``: once per optimizer
    step for a ``train_time_interval`` decision, and twice per round (after
    connect/pause and after the send) to agree on the outcome.

    Attributes:
        broadcast: ``broadcast(obj)`` returns rank 0's ``obj`` on every rank;
            objects are JSON values (``bool``, ``str``, ``None``).
        any_flag: ``any_flag(flag)`` returns ``True`` on every rank if any
            rank passed ``True``.

    Lightning::

        Collectives(broadcast=lambda obj: trainer.strategy.broadcast(obj, src=0),
                    any_flag=lambda flag: trainer.strategy.reduce_boolean_decision(flag, all=False))

    Accelerate (its processes share torch.distributed's default group):
    ``Collectives.from_torch_distributed()``. Their waits are bounded by the
    framework's process-group timeout, not by ``timeout_s``.
    """

    broadcast: Callable[[Any], Any]
    any_flag: Callable[[bool], bool]

    @classmethod
    def from_torch_distributed(cls, group: Any = None) -> Collectives:
        """Collectives over an initialized torch.distributed ``group`` (default:
        the default group), whose rank 0 is trainer rank 0. Objects travel as
        JSON, never pickled."""
        import torch.distributed as dist

        def device() -> torch.device:
            if dist.get_backend(group) == "nccl":
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cpu")

        def src() -> int:
            return 0 if group is None else dist.get_global_rank(group, 0)

        def any_flag(flag: bool) -> bool:
            value = torch.tensor([int(flag)], dtype=torch.int32, device=device())
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
            return bool(value.item())

        def broadcast(obj: Any) -> Any:
            root = src()
            data = json.dumps(obj).encode() if dist.get_rank() == root else b""
            size = torch.tensor([len(data)], dtype=torch.int64, device=device())
            dist.broadcast(size, root, group=group)
            if dist.get_rank() == root:
                buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device())
            else:
                buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device())
            dist.broadcast(buffer, root, group=group)
            return json.loads(buffer.cpu().numpy().tobytes().decode())

        return cls(broadcast=broadcast, any_flag=any_flag)


@dataclass(frozen=True)
class SyncResult:
    """Metrics of one successful round, as seen by this rank.

    Rank 0 transmits, so its ``bytes``/``gbps``/``transfer_seconds`` describe
    the round; other ranks report ``bytes=0`` and their own gather time.
    ``metrics()`` is what the framework adapters log, ``summary()`` the one
    line logged per round.

    Attributes:
        version: the weight version the servers now report.
        step: the training step whose weights were sent.
        seconds: the whole round (connect if needed, pause, send, resume, agreement).
        gather_seconds: producing the tensors (FSDP all-gathers, casts).
        transfer_seconds: the rest of the send: server calls and broadcasts.
        bytes: bytes put on the wire.
        gbps: effective send rate, GB/s (1e9 bytes per second of the send).
        pause_seconds: the ``/pause`` call.
        syncs_completed: successful rounds of this ``WeightSync`` so far, this
            one included (restored from a checkpoint on resume).
        verify_max_logprob_diff: when the round was verified, the largest
            |logprob difference| between a server and the trainer's model on
            the probe prompts (``wt_callbacks.verify``); ``None`` otherwise.
    """

    version: str
    step: int
    seconds: float
    gather_seconds: float
    transfer_seconds: float
    bytes: int
    gbps: float
    pause_seconds: float
    syncs_completed: int
    verify_max_logprob_diff: float | None = None

    def metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        """Every numeric field keyed for a framework logger (``weight_sync/bytes``, ...)."""
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items() if k != "version" and v is not None}

    def summary(self) -> str:
        """The round in one line: ``weight sync step-20: 0.151 s, 800.0 MB, 5.29 GB/s (gather 0.010 s)``."""
        return (
            f"weight sync {self.version}: {self.seconds:.3f} s, {self.bytes / 1e6:.1f} MB, "
            f"{self.gbps:.2f} GB/s (gather {self.gather_seconds:.3f} s)"
            + (
                f", verified: max logprob diff {self.verify_max_logprob_diff:.2e}"
                if self.verify_max_logprob_diff is not None
                else ""
            )
        )


class _RankZeroOnly:
    """The client of trainer ranks > 0. Engines hold a client on every rank but
    only rank 0 calls it, so other ranks need no session (nor a Ray connection)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise WeightTransferError("only trainer rank 0 talks to the servers")

    init_weight_transfer_engine = start_weight_update = update_weights = finish_weight_update = _refuse


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class WeightSync:
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

    A failed round never deadlocks the ranks: every phase ends with an
    agreement, so all ranks take the same branch. With ``on_error="raise"``
    every rank raises ``WeightTransferError`` naming the failure; with
    ``"warn"`` every rank logs, drops the engine (its group is out of step)
    and reconnects at the next due round.
    """

    def __init__(
        self,
        config: SyncConfig,
        *,
        client: VLLMWeightSyncClient | None = None,
        log: Callable[[str], None] = logger.info,
    ) -> None:
        self.config = config
        self._given_client = client
        self._log = log
        self.client: Any = None
        self.source: ModuleSource | None = None
        self.engine: TrainerWeightTransferEngine | None = None
        self.rank = 0
        self.world_size = 1
        self.collectives: Collectives | None = None
        self.last_result: SyncResult | None = None
        self.syncs_completed = 0
        self.failures = 0
        self.last_synced_step: int | None = None
        self.last_sync_time: float | None = None
        self.epochs_completed = 0
        self._last_attempt = time.monotonic()
        self._last_time_check_step: int | None = None
        self._last_attempted_step: int | None = None
        self._paused = False
        self._verifier: Verifier | None = None

    # -- lifecycle -----------------------------------------------------------

    def setup(
        self, module: torch.nn.Module, rank: int = 0, world_size: int = 1, *, collectives: Collectives | None = None
    ) -> None:
        """Build source, client and engine; call on every trainer rank at fit start.

        Connecting to the servers follows ``on_error``: under ``"warn"`` a
        server that is not up yet is retried at the first due round.
        Mistakes in ``module`` / ``include`` / ``exclude`` / ``servers``
        always raise ``ValueError``.
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
        cfg = self.config
        # The engine casts to the wire dtype (before any gather) from its config.
        if cfg.lora == "adapter":
            from wt_callbacks.lora.adapter import AdapterSource

            self.source = AdapterSource(module, submodule=cfg.module)
        else:
            self.source = ModuleSource(module, submodule=cfg.module, include=cfg.include, exclude=cfg.exclude, lora=cfg.lora)
        self._verifier = Verifier.for_config(cfg, self.source) if cfg.verify_every_n_syncs else None
        if self._given_client is not None:
            self.client = self._given_client
        elif rank != 0:
            self.client = _RankZeroOnly()
        # Rank 0 builds its client in _connect, inside an agreed phase: a Ray
        # actor that does not exist must fail every rank, not rank 0 alone.
        self._last_attempt = time.monotonic()
        self._phase(self._connect, "connecting to the servers")

    def close(self) -> None:
        """Leave the transfer group and close a client this object built."""
        self._drop_engine()
        close = getattr(self.client, "close", None)
        if self.client is not self._given_client and callable(close):
            close()
        self.client = None
        self.source = None

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
        sent again.
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
        server may hold anything, whatever the restored state says."""
        return self.sync(step) if self.config.sync_on_fit_start else None

    def sync_at_train_end(self, step: int) -> SyncResult | None:
        """Final sync if ``sync_on_train_end`` and ``step`` is not on the servers yet."""
        if self.config.sync_on_train_end and step != self.last_synced_step:
            return self.sync(step)
        return None

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
        """
        if self.source is None:
            raise RuntimeError("call setup(module, rank, world_size) before sync()")
        version = f"step-{step}" if version is None else version
        start = time.perf_counter()
        # An attempt, failed or not, restarts the interval: a dead server is
        # retried once per interval, not at every step.
        self._last_attempt = time.monotonic() if now is None else now
        pause_seconds = 0.0

        def begin() -> None:
            nonlocal pause_seconds
            if self.engine is None:
                self._connect()
            if self.rank == 0 and self._can_pause():
                self._paused = True
                t0 = time.perf_counter()
                mode = self.config.pause_mode
                bounded(lambda: self.client.pause(mode), "pause", within_s=self.config.timeout_s)
                pause_seconds = time.perf_counter() - t0

        def send() -> None:
            assert self.engine is not None
            self.engine.send_weights(version)
            self._resume()  # before the agreement: generation restarts while the ranks agree

        verify_diff: float | None = None
        verifier = self._verifier_for(verify)

        def check() -> None:
            nonlocal verify_diff
            assert verifier is not None
            verify_diff = verifier.check(self.rank, self.world_size, self.collectives)

        what = f"round for step {step} (version {version!r})"
        try:
            ok = self._phase(begin, what) and self._phase(send, what)
            ok = ok and (verifier is None or self._phase(check, f"verification of {what}"))
        finally:
            # A no-op unless the round failed before send() resumed: the
            # servers are never left paused, whatever happened.
            self._resume(quiet=True)
        if not ok:
            self.failures += 1
            return None
        self.syncs_completed += 1
        self.last_synced_step = step
        self.last_sync_time = time.time()
        stats = self.engine.last_stats
        self.last_result = SyncResult(
            version=version,
            step=step,
            seconds=time.perf_counter() - start,
            gather_seconds=stats.gather_seconds,
            transfer_seconds=max(stats.seconds - stats.gather_seconds, 0.0),
            bytes=stats.bytes,
            gbps=stats.bytes / 1e9 / stats.seconds if stats.seconds > 0 else 0.0,
            pause_seconds=pause_seconds,
            syncs_completed=self.syncs_completed,
            verify_max_logprob_diff=verify_diff,
        )
        if self.rank == 0:
            self._log(self.last_result.summary())
        return self.last_result

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

    def _can_pause(self) -> bool:
        return self.config.pause_mode is not None and callable(getattr(self.client, "pause", None))

    def _resume(self, *, quiet: bool = False) -> None:
        """Resume servers this round paused. ``quiet`` (after a failure) logs
        a failure instead of raising it, so it never masks the error that
        ended the round, and waits at most ``CLEANUP_TIMEOUT_S``."""
        if not self._paused:
            return
        if not quiet:
            # A failure leaves _paused set: the quiet retry follows.
            bounded(self.client.resume, "resume", within_s=self.config.timeout_s)
            self._paused = False
            return
        self._paused = False
        error = best_effort(self.client.resume, "resume", within_s=min(self.config.timeout_s, CLEANUP_TIMEOUT_S))
        if error is not None:
            logger.warning("could not resume the servers after a failed round: %s", error)

    def _connect(self) -> None:
        assert self.source is not None
        cfg = self.config
        if self.client is None:
            self.client = self._build_client()
            if cfg.pause_mode is not None and not callable(getattr(self.client, "pause", None)):
                logger.warning(
                    "pause=%r: %s cannot pause generation; rounds run without pausing (set pause: none "
                    "to silence this)", cfg.pause, type(self.client).__name__,
                )
        self.engine = WeightTransferTrainerFactory.trainer_init(
            cfg.backend,
            cfg.backend_config(),
            cfg.init_info_for(self.rank),
            client=self._adapter_serving() if cfg.lora == "adapter" and self.rank == 0 else self.client,
            source=self.source,
        )

    def _adapter_serving(self) -> VLLMWeightSyncClient:
        """``lora: adapter``: the client that has the servers load each round's
        adapter, once they said they can serve it (before any rendezvous)."""
        from wt_callbacks.lora.adapter import AdapterServingClient

        serving = AdapterServingClient(self.client, self.config.lora_name, self.source, moe=self.source.layout.moe)
        serving.check_servers()
        return serving

    def _build_client(self) -> VLLMWeightSyncClient:
        cfg = self.config
        if cfg.servers:
            try:
                return HTTPVLLMWeightSyncClient(cfg.servers, timeout=cfg.timeout_s, api_key=cfg.api_key)
            except ValueError as e:
                raise ValueError(f"servers: {e}") from e
        return RayVLLMWeightSyncClient(
            cfg.ray_actors, timeout=cfg.timeout_s, namespace=cfg.ray_namespace, api_key=cfg.api_key
        )

    # -- agreement and failure ----------------------------------------------

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
            self._fail(what, self._agree(_describe(e)), e)
            return False
        error = self._agree(None)
        if error is not None:
            self._fail(what, error, None)
            return False
        return True

    def _agree(self, local: str | None) -> str | None:
        """The round's error as every rank sees it: rank 0's if it failed
        (the rank that talks to the servers), else this rank's own.

        The agreement is a collective of the trainer's own ranks: if it fails,
        a trainer rank is gone and no ``on_error`` can keep training, so it
        raises ``WeightTransferError`` on every rank still alive.
        """
        if self.world_size == 1:
            return None if local is None else f"trainer rank 0: {local}"
        assert self.collectives is not None
        try:
            if not self.collectives.any_flag(local is not None):
                return None
            first = self.collectives.broadcast(local if self.rank == 0 else None)
        except Exception as e:
            raise WeightTransferError(
                f"trainer rank {self.rank} could not agree with the other trainer ranks on the weight sync "
                f"round ({_describe(e)}): a trainer rank died or hung"
                + (f"; this rank's own error: {local}" if local else "")
            ) from e
        if first is not None:
            return f"trainer rank 0: {first}"
        return f"trainer rank {self.rank}: {local}" if local else "another trainer rank failed (see its log)"

    def _fail(self, what: str, error: str | None, exc: Exception | None) -> None:
        self._drop_engine()
        message = f"weight sync {what} failed on {error}"
        if self.config.on_error == "raise":
            raise WeightTransferError(
                f"{message}. Set on_error: warn to keep training through server outages"
            ) from exc
        logger.warning("%s; training continues, reconnecting at the next due round", message)

    def _drop_engine(self) -> None:
        if self.engine is None:
            return
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - a broken group must not block the reconnect
            logger.warning("weight sync engine shutdown failed", exc_info=True)
        self.engine = None

    # -- gauges --------------------------------------------------------------

    def gauges(self, step: int, prefix: str = "weight_sync/") -> dict[str, float]:
        """Values that change between rounds, for the framework's logging cadence.

        ``failures``: rounds that failed so far (a round that had to connect
        first counts once; the connect in ``setup`` is no round).
        ``steps_behind``: optimizer steps between ``step`` and the step the
        servers serve; absent until a round succeeded.
        """
        gauges = {f"{prefix}failures": float(self.failures)}
        if self.last_synced_step is not None:
            gauges[f"{prefix}steps_behind"] = float(step - self.last_synced_step)
        return gauges

    # -- resume state --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: rounds done and failed, last synced step and wall-clock time, epochs seen."""
        return {
            "syncs_completed": self.syncs_completed,
            "failures": self.failures,
            "last_synced_step": self.last_synced_step,
            "last_sync_time": self.last_sync_time,
            "epochs_completed": self.epochs_completed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``; keys it lacks keep their current value."""
        unknown = set(state) - set(self.state_dict())
        if unknown:
            raise ValueError(f"weight sync state: unknown keys {sorted(unknown)}")
        for key, value in state.items():
            setattr(self, key, value)
