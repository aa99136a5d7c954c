"""The trainer engine of ``torch_dist``: one packed broadcast per round, over the group ``rendezvous`` formed."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Generic, TypeVar

import torch

from wt_callbacks.transfer.backends.torch_dist.group import TransferGroup
from wt_callbacks.transfer.backends.torch_dist.rendezvous import rendezvous
from wt_callbacks.transfer.backends.torch_dist.waits import wait_for_work
from wt_callbacks.transfer.backends.torch_dist.wire import (
    BACKEND,
    TorchDistTrainerConfig,
    TorchDistTrainerInitInfo,
    check_names_unique,
    update_info_for,
)
from wt_callbacks.transfer.base import (
    CLEANUP_TIMEOUT_S,
    ParamMeta,
    TrainerWeightTransferEngine,
    TransferStats,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferError,
    best_effort,
    bounded,
    check_full_tensors,
    check_sender_owns_all,
    drain,
    finish_with_version,
    in_daemon_thread,
    source_metadata,
)
from wt_callbacks.transfer.packing import broadcast_packed, plan_chunks, slot_capacities
from wt_callbacks.transfer.sources.snapshot import HostSnapshot
from wt_callbacks.transfer.validation import check_niceness, checked_stream

logger = logging.getLogger(__name__)
T = TypeVar("T")

STALE_UPDATE = "already active"
"""What vLLM (and the reference receiver) answer a start while an update is open."""


class _TimedIterator(Generic[T]):
    """Iterates a source, timing the time spent producing tensors (the gathers)."""

    def __init__(self, source: Iterable[T]) -> None:
        self._it = iter(source)
        self.seconds = 0.0
        self.count = 0

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        t0 = time.perf_counter()
        try:
            item = next(self._it)
        finally:
            self.seconds += time.perf_counter() - t0
        self.count += 1
        return item


class TorchDistTrainerWeightTransferEngine(TrainerWeightTransferEngine[TorchDistTrainerInitInfo]):
    """Trainer engine of ``torch_dist``; see the package docstring.

    ``send_weights`` on the sender: ``start_weight_update``, then
    ``update_weights`` on a thread while the main thread gathers, packs and
    broadcasts, then ``finish_weight_update`` with the round's version. Any
    failure marks the engine unusable (the group is out of step): shut it down
    and build a new one. Before raising, the sender finishes iterating the
    source so the other trainer ranks' gathers complete: a dead server never
    deadlocks the trainer.

    A ``HostSnapshot`` source (``send: async``) was gathered when it was
    taken: the sender broadcasts its packed chunks as they lie in it, and
    ``transport="auto"`` never picks NCCL for it (its bytes are in host
    memory, and a NCCL communicator must not run beside the training's own).
    """

    init_info_cls = TorchDistTrainerInitInfo
    config_cls = TorchDistTrainerConfig

    def __init__(
        self,
        config: TorchDistTrainerConfig,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool = True,
        rank: int = 0,
    ) -> None:
        super().__init__(
            config, client=client, source=source.with_wire_dtype(config.wire_dtype), is_sender=is_sender, rank=rank
        )
        self.group: TransferGroup | None = None
        self.worker_init_info: dict[str, Any] | None = None
        self.session_id: str | None = None
        self._failure: str | None = None
        self._pack_buffers: list[torch.Tensor] = []

    @classmethod
    def trainer_init(
        cls,
        config: TorchDistTrainerConfig | Mapping[str, Any] | None = None,
        init_info: TorchDistTrainerInitInfo | Mapping[str, Any] | None = None,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> TorchDistTrainerWeightTransferEngine:
        """``(config, init_info)`` or, as released vLLM calls an engine,
        ``(init_info=...)`` alone (its packing fields and vLLM's defaults in
        force). Everything is checked before the servers are called."""
        if init_info is None:
            raise TypeError("trainer_init() needs an init_info (a TorchDistTrainerInitInfo or a dict)")
        config, init_info = cls.parse_settings(config, init_info)
        check_full_tensors(source, BACKEND)
        check_sender_owns_all(source_metadata(source), BACKEND)
        if not isinstance(client, VLLMWeightSyncClient):
            raise ValueError(
                f"client {type(client).__name__} does not implement VLLMWeightSyncClient "
                "(init_weight_transfer_engine, start_weight_update, update_weights, finish_weight_update)"
            )
        engine = cls(config, client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        if engine.is_sender:
            engine._rendezvous(init_info)
        return engine

    def _rendezvous(self, init_info: TorchDistTrainerInitInfo) -> None:
        met = rendezvous(self.client, self.config, init_info, host_snapshot=isinstance(self.source, HostSnapshot))
        self.group, self.worker_init_info, self.session_id = met.group, met.worker_init_info, met.session_id

    def send_weights(
        self,
        weight_version: str | None = None,
        *,
        commit_gate: Callable[[], None] | None = None,
        prepared: bool = False,
        staging_nice: int = 0,
    ) -> None:
        """One round (see the class docstring); every rank calls it.

        ``commit_gate`` stages the round (``commit: staged``): the servers
        receive it into staging while they keep generating, and apply it only
        at ``finish_weight_update``; ``commit_gate()`` runs on the sender once
        every byte was sent and the servers accepted the update, right before
        that finish (the driver pauses generation there). If the gate or
        anything before the finish fails, the sender leaves the group before
        its clean-up finish, and the servers discard the staged round.
        ``prepared`` (with a gate, ``commit: prepared``): the servers also
        process the staged round into the form they serve before the gate,
        so the commit after it only copies. ``staging_nice`` (0-19, with a
        gate): the niceness the servers stage it at, at least.
        """
        if self._failure is not None:
            raise WeightTransferError(
                f"this engine failed in an earlier round ({self._failure}); call shutdown() and "
                "create a new engine with trainer_init"
            )
        start = time.perf_counter()
        metas = source_metadata(self.source)
        kept = self.source.kept_metadata()
        check_niceness("staging_nice", staging_nice)
        # Every rank checks the same metadata, so all raise before any gather.
        check_names_unique((m.name for m in metas), key="the weight source's metadata()")
        if kept:
            check_names_unique((m.name for m in metas + kept), key="the weight source's metadata() with its kept_metadata()")
        # The packing casts whole tensors into the wire dtype as it copies
        # them; the ranks that do not send only run the gathers.
        items = _TimedIterator(self.source.iter_uncast() if self.is_sender else self.source.gather_only())
        sent = 0
        try:
            if self.is_sender:
                staging = {"prepared": prepared, "staging_nice": staging_nice} if commit_gate is not None else {}
                sent = self._send_round(items, metas, kept, weight_version, commit_gate, staging)
            else:
                for _ in items:
                    pass
        except BaseException as e:
            self._failure = f"{type(e).__name__}: {e}"
            drain(items)
            raise
        finally:
            self.last_stats = TransferStats(
                bytes=sent,
                tensors=items.count if self.is_sender else len(metas),
                seconds=time.perf_counter() - start,
                gather_seconds=items.seconds,
            )

    def _send_round(
        self,
        items: _TimedIterator,
        metas: list[ParamMeta],
        kept: list[ParamMeta],
        weight_version: str | None,
        commit_gate: Callable[[], None] | None,
        staging: dict[str, Any],
    ) -> int:
        if self.group is None:
            raise WeightTransferError("the engine has no transfer group: it was shut down; create a new one")
        server_call: Future | None = None
        try:
            self._start_update()
            update_info = update_info_for(
                metas, session_id=self.session_id, staged=commit_gate is not None, kept=kept, **staging
            )
            server_call = in_daemon_thread(lambda: self.client.update_weights(update_info), "wt-update")
            sent = self._broadcast(checked_stream(items, metas), metas, server_call)
            if commit_gate is not None:
                # Generation pauses for the commit once every worker holds the whole round.
                if self.group.wait_staged(within_s=self.config.timeout_s) is False:
                    logger.warning("torch_dist: the servers did not end staging the round within timeout_s; pausing anyway")
                commit_gate()
        except BaseException:
            self._abandon_round(server_call)
            raise
        try:
            bounded(
                lambda: finish_with_version(self.client, weight_version), "finish_weight_update",
                within_s=self.config.timeout_s,
            )  # fmt: skip
        except BaseException:
            # vLLM keeps a session whose finish raised (a round found
            # incomplete, a server that did not answer) marked active and
            # refuses every later start. Every byte arrived: the group is
            # the session's and stays.
            self._finish_quietly(within_s=min(self.config.timeout_s, CLEANUP_TIMEOUT_S))
            raise
        return sent

    def _start_update(self) -> None:
        """``start_weight_update``. A server still in an update an earlier
        round left open (its trainer died, or the clean-up finish was lost
        while the server was frozen) refuses it as "already active" for good:
        that update is finished first (it keeps the weights it holds), then
        the start is sent again."""
        start = self.client.start_weight_update
        try:
            bounded(start, "start_weight_update", within_s=self.config.timeout_s)
            return
        except Exception as e:
            if STALE_UPDATE not in str(e):
                raise
            logger.warning("torch_dist: a server is still in an earlier round's update; finishing it first (%s)", e)
        # vLLM keeps an update whose finish raised marked active: a second finish ends it.
        for _ in range(2):
            self._finish_quietly(within_s=min(self.config.timeout_s, CLEANUP_TIMEOUT_S))
        bounded(start, "start_weight_update", within_s=self.config.timeout_s)

    def _broadcast(self, tensors: Iterator[torch.Tensor], metas: list[ParamMeta], server_call: Future) -> int:
        """Stream the tensors, then wait for the servers to confirm the update."""
        timeout_s = self.config.timeout_s
        assert self.group is not None
        group = self.group

        def wait(work: Any) -> None:
            wait_for_work(work, timeout_s=timeout_s, server_call=server_call)

        if self.config.packed and isinstance(self.source, HostSnapshot):
            sent = self._broadcast_chunks(self.source.chunks(self.config.packed_buffer_size_bytes), wait)
        elif self.config.packed:
            sizes = [m.nbytes for m in metas]
            chunks = plan_chunks(sizes, self.config.packed_buffer_size_bytes)
            sent = broadcast_packed(
                tensors,
                buffer_size_bytes=self.config.packed_buffer_size_bytes,
                num_buffers=self.config.packed_num_buffers,
                broadcast=group.broadcast,
                wait=wait,
                capacity_hint=slot_capacities(sizes, chunks, self.config.packed_num_buffers),
                device=group.device,
                # On a GPU the caching allocator already reuses freed blocks;
                # keeping them would pin memory the training step wants.
                buffers=self._pack_buffers if self.config.reuse_buffers and group.device.type == "cpu" else None,
                broadcast_parts=group.broadcast_parts,
                dtypes=[m.dtype for m in metas],
            )
        else:
            sent = 0
            for tensor, meta in zip(tensors, metas):
                tensor = tensor.to(device=group.device, dtype=meta.dtype).contiguous()
                wait(group.broadcast(tensor))
                sent += tensor.numel() * tensor.element_size()
        try:
            server_call.result(timeout=timeout_s)
        except FutureTimeout as e:
            raise WeightTransferError(
                f"the servers did not confirm update_weights within timeout_s={timeout_s:g}"
            ) from e
        except Exception as e:
            raise WeightTransferError(f"update_weights failed on the server: {e}") from e
        return sent

    def _broadcast_chunks(self, chunks: list[torch.Tensor], wait: Callable[[Any], None]) -> int:
        """Broadcast packed chunks that already lie in memory (a snapshot's),
        at most ``packed_num_buffers`` in flight, as ``broadcast_packed``
        keeps its buffers. Returns the bytes sent."""
        assert self.group is not None
        in_flight: deque[Any] = deque()
        sent = 0
        for chunk in chunks:
            if not chunk.numel():  # only zero-size tensors: never sent, as in broadcast_packed
                continue
            in_flight.append(self.group.broadcast(chunk))
            sent += chunk.numel()
            if len(in_flight) >= self.config.packed_num_buffers:
                wait(in_flight.popleft())
        while in_flight:
            wait(in_flight.popleft())
        return sent

    def _abandon_round(self, server_call: Future | None) -> None:
        """Leave a failed round so that no server stays stuck in it.

        Leaving the group first makes a server still receiving fail at once
        instead of at its timeout, and one that staged the round whole
        discard it at the finish that follows (it checks that its trainer
        is still in the group before it commits). Then a plain finish ends any update that
        is still open (a server whose start succeeded while another's failed,
        whose update never arrived, or whose start timed out and ran once it
        answered again, as the finish, sent after it, then does too):
        otherwise its next start is refused as "already active", and vLLM
        would serve from the meta tensors of an unfinished layerwise reload.
        Finishing with nothing loaded keeps the old weights (a failed finish
        is retried the same way). Best effort, bounded by
        ``CLEANUP_TIMEOUT_S`` in all: the round's own error is what gets
        raised.
        """
        self.shutdown()
        deadline = time.monotonic() + min(self.config.timeout_s, CLEANUP_TIMEOUT_S)
        try:
            if server_call is not None:
                server_call.exception(timeout=deadline - time.monotonic())
        except FutureTimeout:
            pass
        self._finish_quietly(within_s=max(deadline - time.monotonic(), 0.1))

    def _finish_quietly(self, *, within_s: float) -> None:
        """A plain finish that closes any update a failed round left open,
        waiting at most ``within_s``; an error is expected when the update
        already ended it."""
        error = best_effort(self.client.finish_weight_update, "finish_weight_update", within_s=within_s)
        if error is not None:
            logger.debug("finish after a failed round: %s", error)

    def shutdown(self) -> None:
        self._pack_buffers.clear()
        if self.group is not None:
            self.group.destroy()
            self.group = None
