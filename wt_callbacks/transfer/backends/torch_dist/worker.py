"""The worker engine of ``torch_dist``: joins the trainer's group, receives, loads."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from wt_callbacks.transfer.auth import api_key_or_env
from wt_callbacks.transfer.backends.torch_dist.group import TransferGroup, open_store
from wt_callbacks.transfer.backends.torch_dist.session import (
    API_KEY_ENV,
    check_init_authorized,
    check_update_session,
)
from wt_callbacks.transfer.backends.torch_dist.staging import staging_memory, staging_nice
from wt_callbacks.transfer.backends.torch_dist.wire import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    TorchDistWeightTransferInitInfo,
    TorchDistWeightTransferUpdateInfo,
)
from wt_callbacks.transfer.base import (
    CLEANUP_TIMEOUT_S,
    WeightTransferConfig,
    WeightTransferEngine,
    WeightTransferError,
    in_daemon_thread,
)
from wt_callbacks.transfer.packing import broadcast_packed, receive_packed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceiveStats:
    """One ``update_weights`` as the worker saw it: where a round's time goes.

    ``seconds`` runs from the first receive posted to the last tensor
    loaded; ``waiting_s`` is the part of it the loader spent blocked on the
    transport. Since the next chunks are received while one is loaded, a
    small ``waiting_s`` means the transfer is hidden behind loading and the
    rest is the model's own loading.
    """

    tensors: int
    bytes: int
    seconds: float
    waiting_s: float
    mapped: bool = False
    """It came in memory mapped for it (``WT_STAGING_MEMORY=mapped``)."""


@dataclass(frozen=True)
class _Staging:
    """A staged update receiving on a thread of its own, in its session's group."""

    group: TransferGroup
    receiving: Future


class TorchDistWeightTransferEngine(
    WeightTransferEngine[TorchDistWeightTransferInitInfo, TorchDistWeightTransferUpdateInfo]
):
    """Worker engine of ``torch_dist``: joins the group, receives, loads.

    Weights are handed to ``self.model.load_weights`` as one streaming
    iterable of ``(name, tensor)`` per round. If the target has
    ``validate_update(names, dtypes, shapes)`` it is called before anything is
    received, so a mismatched model is refused before the trainer starts
    streaming. A target whose ``copies_loaded_tensors`` is true is done with
    each tensor before it asks for the next, so the receive buffers rotate
    (``receive_packed``'s ``loader_copies``); otherwise (vLLM's layerwise
    reload keeps a layer's tensors until it is complete) every chunk of a
    round has its own. A target with ``receive_into(name, dtype, shape)``
    names, per tensor, a tensor to receive it straight into (or ``None``),
    which the shm ring does without a receive buffer.

    A request that is not the session's own is refused before any byte
    moves and leaves the session as it was: an init_info that does not prove
    the server's token, is invalid, or names a group that does not form; an
    update_info without the session's secret (``session``), whatever else is
    wrong with it. The session ends when a new one formed, or with its own
    round: a receive error, a trainer that died or left, or an update of the
    session that the model refuses (the trainer streams into the group as it
    is refused); the worker then leaves the group, so the trainer fails at
    once instead of at its timeout, and re-initializes.

    ``api_key``: the server's token, which ``init_weight_transfer_engine``
    must prove (``session``); read from ``VLLM_API_KEY`` (what vLLM's
    ``--api-key`` reads), a host may set it. ``None``: any init_info is
    accepted.

    A staged update (``update_info.staged``, the trainer's ``commit:
    staged``) is accepted as any other (every refusal above runs first), then
    received into the target on a thread of its own, and ``update_weights``
    returns: the host goes on serving from its model while the round
    streams, provided the target is not the served model (the reference
    receiver's ``StagedWeights``; the vLLM plugin collects the tensors and
    applies them at finish). ``finish_weight_update`` waits for it
    (``finish_staging``) and raises, keeping the target's stage out of the
    served model, if it failed, or if the trainer left the group meanwhile
    (a trainer that gave up on the round leaves the group before the
    clean-up finish it sends).

    ``last_receive``: the ``ReceiveStats`` of the round's update, once it
    completed (``None`` from ``start_weight_update`` until then).
    """

    init_info_cls = TorchDistWeightTransferInitInfo
    update_info_cls = TorchDistWeightTransferUpdateInfo
    _warned_unauthenticated = False  # once per process

    def __init__(self, config: WeightTransferConfig, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: TransferGroup | None = None
        self.init_info: TorchDistWeightTransferInitInfo | None = None
        self.api_key: str | None = api_key_or_env(None)
        self.last_receive: ReceiveStats | None = None
        # Host memory only: receive buffers kept between rounds spare the page
        # faults of fresh memory. Not on a GPU, where they would pin a copy of
        # the model in device memory.
        self._receive_buffers: list[torch.Tensor] | None = [] if device.type == "cpu" else None
        self._staging: _Staging | None = None
        self._staging_nice = staging_nice()
        self.staging_memory = staging_memory()

    def worker_rank(self, init_info: TorchDistWeightTransferInitInfo) -> int:
        pc = self.parallel_config
        return init_info.rank_offset + getattr(pc, "data_parallel_index", 0) * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: TorchDistWeightTransferInitInfo) -> None:
        """Check the request, join the new group, then leave any previous session."""
        check_init_authorized(
            self.api_key, init_info.session_id, init_info.session_proof,
            init_info.master_address, init_info.master_port,
        )  # fmt: skip
        if self.api_key is None and not TorchDistWeightTransferEngine._warned_unauthenticated:
            TorchDistWeightTransferEngine._warned_unauthenticated = True
            logger.warning(
                "torch_dist: this server has no token (%s is not set in its environment): "
                "init_weight_transfer_engine accepts any caller", API_KEY_ENV,
            )  # fmt: skip
        rank = self.worker_rank(init_info)
        if not 0 < rank < init_info.world_size:
            raise ValueError(
                f"worker rank {rank} (rank_offset {init_info.rank_offset}) is outside the group of "
                f"world_size={init_info.world_size}; world_size must be 1 + all inference workers"
            )
        if init_info.transport == "nccl" and self.device.type != "cuda":
            raise ValueError(f"transport='nccl' needs a CUDA device; this worker runs on {self.device}")
        store = open_store(
            init_info.master_address,
            init_info.master_port,
            init_info.world_size,
            is_master=False,
            timeout_s=init_info.timeout_s,
        )
        group = TransferGroup.connect(
            store,
            master_address=init_info.master_address,
            rank=rank,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
            transport=init_info.transport,
            device=self.device if init_info.transport == "nccl" else torch.device("cpu"),
            session_id=init_info.session_id,
        )
        # Only once the new group formed: an init that failed (a closed port,
        # a group that never formed) leaves the live session working.
        self.shutdown()
        self.group, self.init_info = group, init_info

    def start_weight_update(self) -> None:
        """A round begins: ``last_receive`` is cleared, so that what the
        round's finish reports (and, in the vLLM plugin, whether it trims the
        heap) is this round's receive, never an earlier one's. Nothing else to
        prepare: the reference receiver stages in its target, the vLLM plugin
        adds layerwise reload here."""
        self.last_receive = None

    def finish_weight_update(self) -> None:
        """Wait for a staged update (``finish_staging``); nothing else to finalize."""
        self.finish_staging()

    def update_weights(self, update_info: Mapping[str, Any] | TorchDistWeightTransferUpdateInfo) -> None:
        """Receive and load one update, or stage it (``update_info.staged``)."""
        typed = self.parse_update_info(update_info)
        if typed.staged and typed.lora is None:  # an adapter round leaves the model alone anyway
            self.stage_weights(typed)
            return
        super().update_weights(typed)

    def stage_weights(self, update_info: TorchDistWeightTransferUpdateInfo, into: Callable[[], Any] | None = None) -> Any:
        """Accept a staged update, then receive it on a thread into the
        target ``into()`` makes once the update is accepted (its checks may
        decide what to stage into; default: the engine's target, which must
        not be the served model). Returns that target."""
        if self._staging is not None:
            raise RuntimeError("a staged weight update is still receiving; finish it before the next one")
        self.accept_update(update_info, self.model)
        model, group, info = self.model if into is None else into(), self.group, self.init_info
        assert group is not None and info is not None
        nice = self.staging_niceness(update_info)

        def stage() -> None:
            # This thread only (each round's is new: nothing to restore); never
            # lowered, which would need a privilege.
            tid = threading.get_native_id()
            if nice > os.getpriority(os.PRIO_PROCESS, tid):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            try:
                self._stream_into(model, group, info, update_info)
            finally:
                group.signal_staged()  # the trainer pauses generation once every worker ended

        receiving = in_daemon_thread(stage, "wt-staging")
        self._staging = _Staging(group, receiving)
        return model

    def staging_niceness(self, update_info: TorchDistWeightTransferUpdateInfo) -> int:
        """The niceness ``update_info``'s staging thread runs at: the round's
        ``staging_nice``, or the server's ``WT_STAGING_NICE`` where higher."""
        return max(self._staging_nice, update_info.staging_nice)

    def finish_staging(self) -> bool:
        """Wait for the staged update, if one is open (``True`` then): at most
        its ``timeout_s``. Raises ``WeightTransferError`` if it failed, did not
        end in time, or its trainer left the group before this commit."""
        staging, self._staging = self._staging, None
        if staging is None:
            return False
        timeout_s = self.init_info.timeout_s if self.init_info is not None else CLEANUP_TIMEOUT_S
        try:
            staging.receiving.result(timeout=timeout_s)
        except FutureTimeout:
            self._leave(staging.group)
            raise WeightTransferError(
                f"the staged update did not arrive within timeout_s={timeout_s:g}; it is discarded"
            ) from None
        except Exception as e:
            raise WeightTransferError(f"the staged update failed and is discarded: {e}") from e
        if staging.group is not self.group or not staging.group.trainer_still_there(within_s=min(timeout_s, CLEANUP_TIMEOUT_S)):
            self._leave(staging.group)
            raise WeightTransferError(
                "the trainer left the transfer group before it committed the staged update: it is discarded"
            )
        return True

    def check_update(self, update_info: TorchDistWeightTransferUpdateInfo, target: Any) -> None:
        """Refuse (raise) an update of this session ``target`` cannot take,
        before anything is received: its ``validate_update(names, dtypes,
        shapes)`` if it has one. A round that keeps tensors (``keep``) goes
        only to a target that says what it keeps: ``validate_update(...,
        kept=(names, dtypes, shapes))`` where its ``keeps_tensors`` is true;
        any other would find it incomplete, or apply it as if it were whole."""
        validate = getattr(target, "validate_update", None)
        shapes = [tuple(s) for s in update_info.shapes]
        if not update_info.kept_names:
            if callable(validate):
                validate(update_info.names, update_info.dtypes, shapes)
            return
        if not getattr(target, "keeps_tensors", False) or not callable(validate):
            raise ValueError(
                f"this server's weight update target ({type(target).__name__}) cannot keep the "
                f"{len(update_info.kept_names)} tensors the round leaves out (keep); the trainer must send every "
                "tensor (send_frozen: every_round)"
            )
        kept = (update_info.kept_names, update_info.kept_dtypes, [tuple(s) for s in update_info.kept_shapes])
        validate(update_info.names, update_info.dtypes, shapes, kept=kept)

    def log_receiving(self, update_info: TorchDistWeightTransferUpdateInfo) -> None:
        """Says that an accepted update begins to stream: a round whose
        trainer died shows in the server's log only by this line."""
        logger.info("torch_dist update_weights: receiving %d tensors", len(update_info.names))

    def receive_weights(self, update_info: TorchDistWeightTransferUpdateInfo) -> None:
        if update_info.lora is not None:
            self._receive_adapter(update_info)
            return
        self.accept_update(update_info, self.model)
        assert self.group is not None and self.init_info is not None
        self._stream_into(self.model, self.group, self.init_info, update_info)

    def accept_update(self, update_info: TorchDistWeightTransferUpdateInfo, target: Any) -> None:
        """Refuse an update that is not this session's, or that ``target``
        cannot take (``check_update``), before any byte moves."""
        if self.group is None or self.init_info is None:
            raise RuntimeError("init_weight_transfer_engine must be called before update_weights")
        check_update_session(self.init_info.session_id, update_info.session_id)
        try:
            self.check_update(update_info, target)
        except Exception:
            # The update is this session's own: its trainer streams into
            # the group right now, and the round is lost. Leaving the
            # group fails the trainer's sends at once.
            self.shutdown()
            raise
        self.log_receiving(update_info)

    def _receive_adapter(self, update_info: TorchDistWeightTransferUpdateInfo) -> None:
        """An adapter round (``lora``): received like weights, into an
        ``AdapterVersion`` instead of the model, and written as that version
        on this host, where a load (``/v1/load_lora_adapter``) then finds it.
        The model is not touched, so there is nothing to stage either."""
        from wt_callbacks.lora.files import AdapterVersion, version_dir

        if self.init_info is None:
            raise RuntimeError("init_weight_transfer_engine must be called before update_weights")
        assert update_info.lora is not None
        lora = update_info.lora
        directory = version_dir(self.init_info.session_id, self.init_info.rank_offset, lora["name"], lora["version"])
        version = AdapterVersion(directory, lora["config"])
        self.accept_update(update_info, version)
        assert self.group is not None
        self._stream_into(version, self.group, self.init_info, update_info)
        version.write()
        logger.info("torch_dist: adapter %r version %s written to %s", lora["name"], lora["version"], directory)

    def _stream_into(
        self,
        model: Any,
        group: TransferGroup,
        info: TorchDistWeightTransferInitInfo,
        update_info: TorchDistWeightTransferUpdateInfo,
    ) -> None:
        """Receive the update from ``group`` (of the session ``info``) into ``model.load_weights``."""
        metas = list(zip(update_info.dtypes, update_info.shapes))
        started, waiting = time.perf_counter(), 0.0
        mapped = False

        def wait(work: Any) -> None:
            nonlocal waiting
            start = time.perf_counter()
            group.wait_received(work)
            waiting += time.perf_counter() - start

        if info.packed:
            copies = bool(getattr(model, "copies_loaded_tensors", False))
            host = group.device.type == "cpu"
            # A target that keeps views holds the whole round; ``mapped``
            # (``WT_STAGING_MEMORY``) gives it memory the OS takes back chunk
            # by chunk as it lets go, where the cache and the heap keep it.
            mapped = host and not copies and self.staging_memory == "mapped"
            tensors = receive_packed(
                metas,
                buffer_size_bytes=info.packed_buffer_size_bytes,
                num_buffers=info.packed_num_buffers,
                broadcast=group.broadcast,
                wait=wait,
                device=group.device,
                buffers=self._receive_buffers if host else None,
                loader_copies=copies,
                destinations=_destinations(model, update_info),
                receive_parts=group.broadcast_parts,
                mapped=mapped,
            )
        else:
            tensors = _receive_unpacked(group, metas, wait)
        weights = zip(update_info.names, tensors)
        try:
            model.load_weights(weights)
            for _ in weights:  # what load_weights skipped must still come off the wire
                pass
        except Exception:
            self._leave(group)
            raise
        nbytes = sum(dtype.itemsize * torch.Size(shape).numel() for dtype, shape in metas)
        self.last_receive = ReceiveStats(len(metas), nbytes, time.perf_counter() - started, waiting, mapped)

    def _leave(self, group: TransferGroup) -> None:
        """Leave ``group`` if it is still the session's (a staging thread's
        may have been replaced by a newer session meanwhile)."""
        if self.group is group:
            self.shutdown()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
        self.init_info = None
        if self._receive_buffers is not None:
            self._receive_buffers.clear()

    @staticmethod
    def trainer_send_weights(iterator: Iterator[Any], trainer_args: dict[str, Any] | Any) -> None:
        """Older call style: broadcast ``(name, tensor)`` items over a group.

        ``trainer_args``: ``{"group": TransferGroup | ProcessGroup, "packed":
        bool, "packed_buffer_size_bytes": int, "packed_num_buffers": int}``;
        the receivers must have been told the same names/dtypes/shapes through
        ``update_weights``.
        """
        args = dict(trainer_args) if isinstance(trainer_args, Mapping) else vars(trainer_args)
        group = args.get("group")
        if group is None:
            raise ValueError("trainer_args: missing required key 'group'")
        broadcast = group.broadcast if isinstance(group, TransferGroup) else (lambda t: group.broadcast(t, args.get("src", 0)))
        tensors = (tensor for _, tensor in iterator)
        if args.get("packed", True):
            broadcast_packed(
                tensors,
                buffer_size_bytes=int(args.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES)),
                num_buffers=int(args.get("packed_num_buffers", DEFAULT_PACKED_NUM_BUFFERS)),
                broadcast=broadcast,
                wait=lambda work: work.wait(),
            )
        else:
            for tensor in tensors:
                broadcast(tensor.contiguous()).wait()


def _destinations(model: Any, update_info: TorchDistWeightTransferUpdateInfo) -> list[torch.Tensor | None] | None:
    """The target's ``receive_into(name, dtype, shape)`` for every tensor,
    if it has one: where it wants a tensor received straight into."""
    receive_into = getattr(model, "receive_into", None)
    if not callable(receive_into):
        return None
    return [
        receive_into(name, dtype, tuple(shape))
        for name, dtype, shape in zip(update_info.names, update_info.dtypes, update_info.shapes)
    ]


def _receive_unpacked(group: TransferGroup, metas: list[tuple[torch.dtype, list[int]]], wait: Any) -> Iterator[torch.Tensor]:
    for dtype, shape in metas:
        tensor = torch.empty(tuple(shape), dtype=dtype, device=group.device)
        wait(group.broadcast(tensor))
        yield tensor
