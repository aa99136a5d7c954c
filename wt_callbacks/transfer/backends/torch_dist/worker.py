"""The worker engine of ``torch_dist``: joins the trainer's group, receives, loads."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from wt_callbacks.transfer.backends.torch_dist.group import TransferGroup, open_store
from wt_callbacks.transfer.backends.torch_dist.session import (
    API_KEY_ENV,
    check_init_authorized,
    check_update_session,
)
from wt_callbacks.transfer.backends.torch_dist.wire import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    TorchDistWeightTransferInitInfo,
    TorchDistWeightTransferUpdateInfo,
)
from wt_callbacks.transfer.base import WeightTransferConfig, WeightTransferEngine
from wt_callbacks.transfer.clients import api_key_or_env
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

    ``last_receive``: the ``ReceiveStats`` of the last update that completed.
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
        """Nothing to prepare: the reference receiver stages in its target,
        the vLLM plugin adds layerwise reload here."""

    def finish_weight_update(self) -> None:
        """Nothing to finalize (see ``start_weight_update``)."""

    def check_update(self, update_info: TorchDistWeightTransferUpdateInfo) -> None:
        """Refuse (raise) an update of this session the model cannot take,
        before anything is received: the target's ``validate_update(names,
        dtypes, shapes)`` if it has one."""
        validate = getattr(self.model, "validate_update", None)
        if callable(validate):
            validate(update_info.names, update_info.dtypes, [tuple(s) for s in update_info.shapes])

    def log_receiving(self, update_info: TorchDistWeightTransferUpdateInfo) -> None:
        """Says that an accepted update begins to stream: a round whose
        trainer died shows in the server's log only by this line."""
        logger.info("torch_dist update_weights: receiving %d tensors", len(update_info.names))

    def receive_weights(self, update_info: TorchDistWeightTransferUpdateInfo) -> None:
        if self.group is None or self.init_info is None:
            raise RuntimeError("init_weight_transfer_engine must be called before update_weights")
        check_update_session(self.init_info.session_id, update_info.session_id)
        if update_info.lora is not None:
            self._receive_adapter(update_info)
            return
        self._receive(update_info)

    def _receive_adapter(self, update_info: TorchDistWeightTransferUpdateInfo) -> None:
        """An adapter round (``lora``): received like weights, into an
        ``AdapterVersion`` instead of the model, and written as that version
        on this host, where a load (``/v1/load_lora_adapter``) then finds it.
        The model is not touched."""
        from wt_callbacks.lora.files import AdapterVersion, version_dir

        assert self.init_info is not None and update_info.lora is not None
        lora = update_info.lora
        directory = version_dir(self.init_info.session_id, self.init_info.rank_offset, lora["name"], lora["version"])
        version = AdapterVersion(directory, lora["config"])
        model = self.model
        self.model = version
        try:
            self._receive(update_info)
        finally:
            self.model = model
        version.write()
        logger.info("torch_dist: adapter %r version %s written to %s", lora["name"], lora["version"], directory)

    def _receive(self, update_info: TorchDistWeightTransferUpdateInfo) -> None:
        """Receive the update's tensors and load them into ``self.model``."""
        assert self.init_info is not None and self.group is not None
        try:
            self.check_update(update_info)
        except Exception:
            # The update is this session's own: its trainer streams into
            # the group right now, and the round is lost. Leaving the
            # group fails the trainer's sends at once.
            self.shutdown()
            raise
        self.log_receiving(update_info)
        info, group = self.init_info, self.group
        metas = list(zip(update_info.dtypes, update_info.shapes))
        started, waiting = time.perf_counter(), 0.0

        def wait(work: Any) -> None:
            nonlocal waiting
            start = time.perf_counter()
            group.wait_received(work)
            waiting += time.perf_counter() - start

        if info.packed:
            tensors = receive_packed(
                metas,
                buffer_size_bytes=info.packed_buffer_size_bytes,
                num_buffers=info.packed_num_buffers,
                broadcast=group.broadcast,
                wait=wait,
                device=group.device,
                buffers=self._receive_buffers if group.device.type == "cpu" else None,
                loader_copies=bool(getattr(self.model, "copies_loaded_tensors", False)),
                destinations=self._destinations(update_info),
                receive_parts=group.broadcast_parts,
            )
        else:
            tensors = self._receive_unpacked(metas, wait)
        weights = zip(update_info.names, tensors)
        try:
            self.model.load_weights(weights)
            for _ in weights:  # what load_weights skipped must still come off the wire
                pass
        except Exception:
            self.shutdown()
            raise
        nbytes = sum(dtype.itemsize * torch.Size(shape).numel() for dtype, shape in metas)
        self.last_receive = ReceiveStats(len(metas), nbytes, time.perf_counter() - started, waiting)

    def _destinations(self, update_info: TorchDistWeightTransferUpdateInfo) -> list[torch.Tensor | None] | None:
        """The target's ``receive_into(name, dtype, shape)`` for every tensor,
        if it has one: where it wants a tensor received straight into."""
        receive_into = getattr(self.model, "receive_into", None)
        if not callable(receive_into):
            return None
        return [
            receive_into(name, dtype, tuple(shape))
            for name, dtype, shape in zip(update_info.names, update_info.dtypes, update_info.shapes)
        ]

    def _receive_unpacked(self, metas: list[tuple[torch.dtype, list[int]]], wait: Any) -> Iterator[torch.Tensor]:
        assert self.group is not None
        for dtype, shape in metas:
            tensor = torch.empty(tuple(shape), dtype=dtype, device=self.group.device)
            wait(self.group.broadcast(tensor))
            yield tensor

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

