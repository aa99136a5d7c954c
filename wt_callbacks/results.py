"""``SyncResult``: what one successful round did, as the framework adapters log it."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SyncResult:
    """Metrics of one successful round, as seen by this rank.

    Rank 0 transmits, so its ``bytes``/``gbps``/``transfer_seconds`` describe
    the round; other ranks report ``bytes=0`` and their own gather time
    (under ``send: async`` every rank reports rank 0's figures, which reach
    them with the round's outcome). ``metrics()`` is what the framework
    adapters log, ``summary()`` the one line logged per round.

    Attributes:
        version: the weight version the servers now report.
        step: the training step whose weights were sent.
        seconds: the whole round (connect if needed, pause, send, resume,
            agreement); under ``send: async``, rank 0's background round.
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
        stall_seconds: how long the training loop waited for this round:
            the whole round under ``send: blocking``; the wait for the round
            before it plus the snapshot under ``send: async``.
        generation_paused_seconds: how long the servers' generation was
            paused, from the ``/pause`` call to the ``/resume`` answer (0
            with ``pause: none``): the whole round with ``commit: inline``,
            the commit alone with ``commit: staged``.
        snapshot_seconds: ``send: async`` only: copying the sent tensors
            (gathers included) into the host snapshot.
        latency_seconds: ``send: async`` only: from the start of the
            snapshot until the servers acknowledged the round.
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
    stall_seconds: float = 0.0
    generation_paused_seconds: float = 0.0
    snapshot_seconds: float | None = None
    latency_seconds: float | None = None

    def metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        """Every numeric field keyed for a framework logger (``weight_sync/bytes``, ...)."""
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items() if k != "version" and v is not None}

    def summary(self) -> str:
        """The round in one line: ``weight sync step-20: 0.151 s, 800.0 MB, 5.29 GB/s (gather 0.010 s)``;
        under ``send: async`` with the trainer's stall and the latency."""
        line = (
            f"weight sync {self.version}: {self.seconds:.3f} s, {self.bytes / 1e6:.1f} MB, "
            f"{self.gbps:.2f} GB/s (gather {self.gather_seconds:.3f} s)"
        )
        if self.latency_seconds is not None:
            line += f", in the background: training stalled {self.stall_seconds:.3f} s, acknowledged after {self.latency_seconds:.3f} s"
        if self.verify_max_logprob_diff is not None:
            line += f", verified: max logprob diff {self.verify_max_logprob_diff:.2e}"
        return line
