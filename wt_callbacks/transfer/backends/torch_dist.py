"""Backend ``torch_dist``: a stateless torch.distributed group, trainer -> workers.

Both sides live here because they must agree on everything: the wire dicts,
the rank layout and the packed chunk rule.

The group is built without touching torch.distributed's global state (a
training job already has its own default group): trainer rank 0 runs a
``TCPStore`` master on ``master_address:master_port``; every inference worker
connects to it and joins a ``ProcessGroupGloo`` (CPU tensors) or
``ProcessGroupNCCL`` (CUDA tensors) under a ``PrefixStore``. Ranks: the
trainer is 0, a worker is ``rank_offset + dp_index * world + rank`` (vLLM's
layout). Every wait is bounded by ``timeout_s``: a dead peer raises, it never
hangs.

Transport ``shm`` (what ``auto`` picks on a CPU trainer whose
``master_address`` is a loopback address, where every worker is necessarily
on the trainer's host): the gloo group forms exactly as above, but
broadcasts stream through a small ring in ``/dev/shm`` instead of loopback
TCP. Loopback TCP is CPU-bound: the kernel copies every byte on send and
again on receive, and those copies compete with packing and loading for the
same cores (measured here at 47% of the raw TCP ceiling); through the ring a
byte is copied once into shared memory by the trainer and once out of it by
each worker, on both sides in parallel. Every rank reports whether it could
map the ring; unless all could, ``auto`` falls back to gloo broadcasts on
every rank and explicit ``shm`` fails naming the fix. See ``ShmRing``.

The wire dicts are those of vLLM's dense ``nccl`` backend (worker init_info
``master_address, master_port, rank_offset, world_size, packed,
packed_buffer_size_bytes, packed_num_buffers``; update_info ``names,
dtype_names, shapes``) plus ``timeout_s`` and ``transport`` (``"gloo"``,
``"nccl"`` or ``"shm"``: the gloo group plus the ring, with the trainer
deciding after the negotiation whether the ring is used), so moving to stock
vLLM later is a config change.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from wt_callbacks.transfer.base import (
    ParamMeta,
    TrainerWeightTransferEngine,
    TransferStats,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferConfig,
    WeightTransferEngine,
    WeightTransferError,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    drain,
    dtype_from_name,
    dtype_name,
    finish_with_version,
)
from wt_callbacks.transfer.backends.shm_ring import ShmRing, join_ring, offer_ring
from wt_callbacks.transfer.clients import group_world_size
from wt_callbacks.transfer.packing import broadcast_packed, plan_chunks, receive_packed, slot_capacities
from wt_callbacks.transfer.validation import check_positive, parse_wire_dtype

logger = logging.getLogger(__name__)

BACKEND = "torch_dist"
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 64 * 1024 * 1024
"""Trainer default: 64 MiB chunks. Smaller chunks pipeline better (the receiver
loads chunk k while chunk k+1 is on the wire) and bound memory lower; on this
CPU box 64 MiB was as fast as 256 MiB to the reference receiver and faster
into vLLM (see benchmarks/)."""
WORKER_DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024**3
"""vLLM's worker-side default, kept for wire compatibility."""
DEFAULT_PACKED_NUM_BUFFERS = 2
DEFAULT_TIMEOUT_S = 300.0
TRANSPORTS = ("auto", "gloo", "nccl", "shm")
WORKER_TRANSPORTS = ("gloo", "nccl", "shm")
_STORE_PREFIX = "wt_callbacks/torch_dist"


# --------------------------------------------------------------------------- #
# Typed config and wire dicts
# --------------------------------------------------------------------------- #


@dataclass
class TorchDistTrainerConfig(WeightTransferConfig):
    """Trainer-side settings of the ``torch_dist`` backend.

    Attributes:
        packed: broadcast many tensors per collective (recommended); ``False``
            sends one collective per tensor.
        packed_buffer_size_bytes: target chunk size.
        packed_num_buffers: buffers rotated while packing (2 = pack the next
            chunk while the previous one is on the wire).
        dtype: wire dtype name for floating-point parameters (``"bfloat16"``);
            ``None`` sends each parameter in its own dtype. The cast happens
            before any FSDP gather.
        timeout_s: bound on every wait (rendezvous, each broadcast, each
            server call); also sent to the workers.
        transport: ``"auto"`` (NCCL when the trainer has CUDA; else
            ``"shm"`` with a fallback to gloo when ``master_address`` is a
            loopback address; else gloo), ``"gloo"``, ``"nccl"`` or
            ``"shm"`` (gloo group, broadcasts through a ring in ``/dev/shm``;
            every server must run on this host and share its ``/dev/shm``,
            or the rendezvous fails naming the fix). Workers are told
            ``"shm"`` for both shm cases; the trainer alone decides, after
            every rank reported whether it could map the ring, whether the
            ring is used, so all ranks agree.
        reuse_buffers: keep the packing buffers between rounds (host memory
            only; on a GPU the caching allocator reuses freed blocks anyway).
            Fresh host memory is page-faulted on first touch, which costs more
            than the copy into it; keeping them costs the ``packed_num_buffers``
            buffers of memory while the trainer is not syncing.
    """

    backend: str = BACKEND
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    dtype: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    transport: str = "auto"
    reuse_buffers: bool = True

    def __post_init__(self) -> None:
        if self.backend != BACKEND:
            raise ValueError(f"backend must be {BACKEND!r} for this config, got {self.backend!r}")
        check_positive("packed_buffer_size_bytes", self.packed_buffer_size_bytes, integer=True)
        check_positive("packed_num_buffers", self.packed_num_buffers, integer=True)
        check_positive("timeout_s", self.timeout_s)
        if self.dtype is not None:
            parse_wire_dtype(self.dtype)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of {TRANSPORTS}")

    @property
    def wire_dtype(self) -> torch.dtype | None:
        return None if self.dtype is None else parse_wire_dtype(self.dtype)


@dataclass
class TorchDistTrainerInitInfo(WeightTransferInitInfo):
    """Trainer-side rendezvous info.

    Attributes:
        master_address: address the trainer (rank 0) listens on and the
            workers connect to; it must be reachable from the servers.
        master_port: port for the rendezvous store; ``0`` picks a free one.
        rank: this process's trainer rank; rank 0 is the sender.
        world_size: 1 + all inference workers; when omitted, the sender asks
            the client (``get_world_size()``) and adds 1.
    """

    master_address: str
    master_port: int
    rank: int
    world_size: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in 0..65535, got {self.master_port}")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if self.world_size is not None and self.world_size < 2:
            raise ValueError(
                f"world_size must be >= 2 (the trainer plus at least one worker), got {self.world_size}"
            )

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


@dataclass(kw_only=True)
class TorchDistWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker-side init dict (vLLM's dense NCCL keys + ``timeout_s``, ``transport``).

    ``transport``: ``"gloo"``, ``"nccl"`` or ``"shm"``. ``"shm"`` joins the
    gloo group, then maps the trainer's ring from ``/dev/shm`` and reports
    whether that worked; the trainer answers whether the ring is used (all
    ranks mapped it), or gloo broadcasts are (a rank could not, and the
    trainer asked for ``auto``), or the rendezvous fails (it asked for
    ``shm``). The path and layout of the ring travel in the rendezvous store,
    not here: they exist only once the group is forming.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = WORKER_DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S
    transport: str = "gloo"

    def __post_init__(self) -> None:
        if self.rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer), got {self.rank_offset}")
        if self.world_size < 2:
            raise ValueError(f"world_size must be >= 2, got {self.world_size}")
        check_positive("packed_buffer_size_bytes", self.packed_buffer_size_bytes, integer=True)
        check_positive("packed_num_buffers", self.packed_num_buffers, integer=True)
        check_positive("timeout_s", self.timeout_s)
        if self.transport not in WORKER_TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of {WORKER_TRANSPORTS}")


@dataclass
class TorchDistWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per-round update dict: the tensors that follow on the wire, in order."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must have equal lengths, got "
                f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}"
            )
        self.dtypes = [dtype_from_name(n, key=f"dtype_names[{i}]") for i, n in enumerate(self.dtype_names)]
        for i, shape in enumerate(self.shapes):
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"shapes[{i}] ({self.names[i]}) must be non-negative ints, got {shape}")


def update_info_for(metas: Iterable[ParamMeta]) -> dict[str, Any]:
    """The JSON update dict describing ``metas``."""
    metas = list(metas)
    return {
        "names": [m.name for m in metas],
        "dtype_names": [dtype_name(m.dtype) for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


# --------------------------------------------------------------------------- #
# The transfer group
# --------------------------------------------------------------------------- #


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _local_address_towards(host: str) -> str:
    """The local IP the OS would use to reach ``host`` (gloo binds to it)."""
    if _is_loopback(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP connect sends nothing; it only picks a route
        return s.getsockname()[0]


def open_store(
    master_address: str, master_port: int, world_size: int, *, is_master: bool, timeout_s: float
) -> dist.TCPStore:
    """Rendezvous store; the master binds ``master_address:master_port``."""
    try:
        return dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=is_master,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:
        if is_master:
            raise WeightTransferError(
                f"cannot listen on master_address={master_address!r} master_port={master_port}: {e}. "
                "Pick a free port (or 0 for any free port) and an address of this machine that the "
                "servers can reach"
            ) from e
        raise WeightTransferError(
            f"cannot reach the trainer's rendezvous store at {master_address}:{master_port} "
            f"within {timeout_s:g} s: {e}"
        ) from e


class TransferGroup:
    """The trainer plus inference workers: one stateless process group.

    ``broadcast`` is asynchronous and returns a work handle; rank 0 is always
    the source. ``destroy`` aborts the group so a peer stuck in a collective
    with us gets an error right away instead of waiting for its timeout.
    ``transport`` says what broadcasts travel over: ``"gloo"``, ``"nccl"``
    or ``"shm"`` (the ring ``shm``; the gloo group is still there).
    """

    def __init__(self, store: dist.Store, pg: Any, rank: int, world_size: int, device: torch.device,
                 shm: ShmRing | None = None) -> None:  # fmt: skip
        self.store = store
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.shm = shm
        self.transport = "shm" if shm is not None else "nccl" if device.type == "cuda" else "gloo"

    @classmethod
    def connect(
        cls,
        store: dist.Store,
        *,
        master_address: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        transport: str,
        device: torch.device,
        fallback_to_gloo: bool = False,
    ) -> TransferGroup:
        """Join the group (blocks until every rank joined, at most ``timeout_s``).

        ``transport="shm"`` then negotiates the ring (see the module
        docstring); ``fallback_to_gloo`` matters on rank 0 only, which
        decides for every rank: when a rank cannot map the ring, use gloo
        broadcasts (``True``, what ``auto`` asks for) or fail naming the fix.
        """
        prefix = dist.PrefixStore(_STORE_PREFIX, store)
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if transport == "nccl":
                # Untested here (no GPU): the CPU build of torch has no NCCL.
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
            else:
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address_towards(master_address))]
                pg = dist.ProcessGroupGloo(prefix, rank, world_size, opts)
        except (RuntimeError, OSError) as e:
            raise WeightTransferError(
                f"the transfer group of world_size={world_size} did not form within timeout_s={timeout_s:g} "
                f"(this is rank {rank}): {e}. world_size must be 1 + all inference workers of all servers"
            ) from e
        if transport != "shm":
            return cls(store, pg, rank, world_size, device)
        try:
            if rank == 0:
                shm = offer_ring(prefix, world_size=world_size, timeout_s=timeout_s, fallback_to_gloo=fallback_to_gloo)
            else:
                shm = join_ring(prefix, rank=rank, world_size=world_size, timeout_s=timeout_s)
        except BaseException as e:
            cls(store, pg, rank, world_size, device).destroy()
            if isinstance(e, WeightTransferError) or not isinstance(e, Exception):
                raise
            raise WeightTransferError(
                f"the shared-memory ring negotiation did not finish within timeout_s={timeout_s:g} "
                f"(this is rank {rank}; did a rank die?): {e}"
            ) from e
        return cls(store, pg, rank, world_size, device, shm)

    def broadcast(self, tensor: torch.Tensor) -> Any:
        if self.shm is not None:
            return self.shm.broadcast(tensor)
        return self.pg.broadcast(tensor, 0)

    @property
    def broadcast_parts(self) -> Callable[[list[torch.Tensor]], Any] | None:
        """Broadcast several tensors as one message (what the receivers get is
        their concatenation), or None when the transport cannot: only the
        ring can, and it lets the sender skip the pack copy."""
        return self.shm.broadcast_parts if self.shm is not None else None

    def destroy(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        try:
            self.pg.abort()
        except Exception:  # noqa: BLE001 - best effort: the peer may already be gone
            logger.debug("abort of the transfer group failed", exc_info=True)
        self.pg = None
        self.store = None


def _spawn(fn: Callable[[], Any], name: str) -> Future:
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


def _raise_if_failed(future: Future | None, what: str) -> None:
    if future is not None and future.done() and future.exception() is not None:
        raise WeightTransferError(f"{what} failed on the server: {future.exception()}") from future.exception()


def _wait_work(work: Any, *, timeout_s: float, server_call: Future | None = None) -> None:
    """Wait for a collective, checking the concurrent server call meanwhile.

    A server that rejects the update (unknown name, wrong shape) answers its
    HTTP call with an error and stops receiving; polling that call turns what
    would be a wait until the timeout into an immediate, explicit error.
    """
    deadline = time.monotonic() + timeout_s
    pause = 5e-5
    while not work.is_completed():
        _raise_if_failed(server_call, "update_weights")
        if time.monotonic() > deadline:
            raise WeightTransferError(f"broadcast did not complete within timeout_s={timeout_s:g}")
        time.sleep(pause)
        pause = min(pause * 2, 5e-3)
    try:
        work.wait()
    except RuntimeError as e:
        # A server that refused the update leaves the group, so our broadcast
        # fails too; its own answer says why, the socket error does not.
        if server_call is not None:
            try:
                server_error = server_call.exception(timeout=5)
            except FutureTimeout:
                server_error = None
            if server_error is not None:
                raise WeightTransferError(f"update_weights failed on the server: {server_error}") from e
        raise WeightTransferError(f"broadcast to the servers failed (did a server crash?): {e}") from e


# --------------------------------------------------------------------------- #
# Trainer side
# --------------------------------------------------------------------------- #


class _TimedIterator:
    """Iterates a source, timing the time spent producing tensors (the gathers)."""

    def __init__(self, source: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._it = iter(source)
        self.seconds = 0.0
        self.count = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        t0 = time.perf_counter()
        try:
            item = next(self._it)
        finally:
            self.seconds += time.perf_counter() - t0
        self.count += 1
        return item



def _checked(items: Iterator[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> Iterator[torch.Tensor]:
    """Yield tensors, raising on the first disagreement with ``metadata()``.

    The receivers sized their buffers and chunk cuts from the metadata; a
    tensor that differs would corrupt every tensor after it.
    """
    i = -1
    for i, (name, tensor) in enumerate(items):
        if i >= len(metas):
            raise ValueError(
                f"the weight source yielded more tensors than metadata() lists ({len(metas)}); "
                f"first extra: {name!r}"
            )
        m = metas[i]
        if name != m.name or tensor.dtype != m.dtype or tuple(tensor.shape) != m.shape:
            raise ValueError(
                f"the weight source disagrees with its metadata() at index {i}: metadata says "
                f"{m.name!r} {dtype_name(m.dtype)} {list(m.shape)}, iteration yielded "
                f"{name!r} {dtype_name(tensor.dtype)} {list(tensor.shape)}"
            )
        yield tensor
    if i + 1 != len(metas):
        raise ValueError(
            f"the weight source yielded {i + 1} tensors but metadata() lists {len(metas)}; "
            f"first missing: {metas[i + 1].name!r}"
        )


class TorchDistTrainerWeightTransferEngine(
    TrainerWeightTransferEngine[TorchDistTrainerConfig, TorchDistTrainerInitInfo]
):
    """Trainer engine of ``torch_dist``; see the module docstring.

    ``send_weights`` on the sender: ``start_weight_update``, then
    ``update_weights`` on a thread while the main thread gathers, packs and
    broadcasts, then ``finish_weight_update`` with the round's version. Any
    failure marks the engine unusable (the group is out of step): shut it down
    and build a new one. Before raising, the sender finishes iterating the
    source so the other trainer ranks' gathers complete: a dead server never
    deadlocks the trainer.
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
    ) -> None:
        super().__init__(config, client=client, source=source.with_wire_dtype(config.wire_dtype), is_sender=is_sender)
        self.group: TransferGroup | None = None
        self.worker_init_info: dict[str, Any] | None = None
        self._failure: str | None = None
        self._pack_buffers: list[torch.Tensor] = []

    @classmethod
    def trainer_init(
        cls,
        config: TorchDistTrainerConfig | Mapping[str, Any],
        init_info: TorchDistTrainerInitInfo | Mapping[str, Any],
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
    ) -> TorchDistTrainerWeightTransferEngine:
        config = cls.parse_config(config)
        init_info = cls.parse_init_info(init_info)
        if not isinstance(source, WeightSource):
            raise ValueError(f"source must be a WeightSource (e.g. ModuleSource(model)), got {type(source).__name__}")
        if not isinstance(client, VLLMWeightSyncClient):
            raise ValueError(
                f"client {type(client).__name__} does not implement VLLMWeightSyncClient "
                "(init_weight_transfer_engine, start_weight_update, update_weights, finish_weight_update)"
            )
        engine = cls(config, client=client, source=source, is_sender=init_info.is_sender)
        if engine.is_sender:
            engine._rendezvous(init_info)
        return engine

    def _transport(self, master_address: str) -> str:
        if self.config.transport != "auto":
            return self.config.transport
        if torch.cuda.is_available():
            return "nccl"
        # A worker can reach a loopback master only from this host, so the
        # ring is worth offering; the negotiation still checks each worker
        # shares this /dev/shm (a container may not).
        return "shm" if _is_loopback(master_address) else "gloo"

    def _rendezvous(self, init_info: TorchDistTrainerInitInfo) -> None:
        world_size = init_info.world_size if init_info.world_size is not None else group_world_size(self.client)
        timeout_s = self.config.timeout_s
        transport = self._transport(init_info.master_address)
        device = torch.device("cuda", torch.cuda.current_device()) if transport == "nccl" else torch.device("cpu")
        store = open_store(init_info.master_address, init_info.master_port, world_size, is_master=True, timeout_s=timeout_s)
        self.worker_init_info = {
            "master_address": init_info.master_address,
            "master_port": store.port,
            "rank_offset": 1,
            "world_size": world_size,
            "packed": self.config.packed,
            "packed_buffer_size_bytes": self.config.packed_buffer_size_bytes,
            "packed_num_buffers": self.config.packed_num_buffers,
            "timeout_s": timeout_s,
            "transport": transport,
        }
        payload = dict(self.worker_init_info)
        server_call = _spawn(lambda: self.client.init_weight_transfer_engine(payload), "wt-init")
        joined = _spawn(
            lambda: TransferGroup.connect(
                store,
                master_address=init_info.master_address,
                rank=0,
                world_size=world_size,
                timeout_s=timeout_s,
                transport=transport,
                device=device,
                fallback_to_gloo=self.config.transport == "auto",
            ),
            "wt-rendezvous",
        )
        try:
            # The join may take timeout_s for the group and again for the ring.
            deadline = time.monotonic() + 2 * timeout_s + 5
            while not (joined.done() and server_call.done()):
                _raise_if_failed(server_call, "init_weight_transfer_engine")
                if joined.done() and joined.exception() is not None:
                    raise joined.exception()
                if time.monotonic() > deadline:
                    raise WeightTransferError(
                        f"rendezvous with the servers did not finish within timeout_s={timeout_s:g}"
                    )
                time.sleep(0.01)
            _raise_if_failed(server_call, "init_weight_transfer_engine")
        except BaseException:
            # A group the join still forms after we gave up has no owner: it
            # would keep its store port, ring and heartbeat alive for good.
            joined.add_done_callback(lambda f: f.exception() is None and f.result().destroy())
            raise
        self.group = joined.result()
        logger.info(
            "torch_dist: %s group of %d ranks formed on %s:%d",
            self.group.transport, world_size, init_info.master_address, store.port,
        )

    def send_weights(self, weight_version: str | None = None) -> None:
        if self._failure is not None:
            raise WeightTransferError(
                f"this engine failed in an earlier round ({self._failure}); call shutdown() and "
                "create a new engine with trainer_init"
            )
        start = time.perf_counter()
        metas = self.source.metadata()
        items = _TimedIterator(self.source)
        sent = 0
        try:
            if self.is_sender:
                sent = self._send_round(items, metas, weight_version)
            else:
                for _ in items:
                    pass
        except BaseException as e:
            self._failure = f"{type(e).__name__}: {e}"
            drain(items)
            raise
        finally:
            self.last_stats = TransferStats(
                bytes=sent, tensors=items.count, seconds=time.perf_counter() - start, gather_seconds=items.seconds
            )

    def _send_round(self, items: _TimedIterator, metas: list[ParamMeta], weight_version: str | None) -> int:
        if self.group is None:
            raise WeightTransferError("the engine has no transfer group: it was shut down; create a new one")
        self.client.start_weight_update()
        update_info = update_info_for(metas)
        server_call = _spawn(lambda: self.client.update_weights(update_info), "wt-update")
        try:
            sent = self._broadcast(_checked(items, metas), metas, server_call)
        except BaseException:
            self._abandon_round(server_call)
            raise
        finish_with_version(self.client, weight_version)
        return sent

    def _broadcast(self, tensors: Iterator[torch.Tensor], metas: list[ParamMeta], server_call: Future) -> int:
        """Stream the tensors, then wait for the servers to confirm the update."""
        timeout_s = self.config.timeout_s
        assert self.group is not None
        group = self.group

        def wait(work: Any) -> None:
            _wait_work(work, timeout_s=timeout_s, server_call=server_call)

        if self.config.packed:
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
            )
        else:
            sent = 0
            for tensor in tensors:
                tensor = tensor.to(group.device).contiguous()
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

    def _abandon_round(self, server_call: Future) -> None:
        """Leave a failed round so that no server stays stuck in it.

        Leaving the group first makes a server still receiving fail at once
        instead of at its timeout. Then a plain finish ends any session that
        is still open (a server whose start succeeded while another's failed,
        or whose update never arrived): otherwise its next start is refused
        as "already active", and vLLM would serve from the meta tensors of an
        unfinished layerwise reload. Finishing with nothing loaded keeps the
        old weights. Best effort: the round's own error is what gets raised.
        """
        self.shutdown()
        try:
            server_call.exception(timeout=min(self.config.timeout_s, 10.0))
        except FutureTimeout:
            pass
        try:
            self.client.finish_weight_update()
        except Exception as e:  # noqa: BLE001 - expected when the update already ended the session
            logger.debug("finish after a failed round: %s", e)

    def shutdown(self) -> None:
        self._pack_buffers.clear()
        if self.group is not None:
            self.group.destroy()
            self.group = None


# --------------------------------------------------------------------------- #
# Worker side
# --------------------------------------------------------------------------- #


class TorchDistWeightTransferEngine(
    WeightTransferEngine[TorchDistWeightTransferInitInfo, TorchDistWeightTransferUpdateInfo]
):
    """Worker engine of ``torch_dist``: joins the group, receives, loads.

    Weights are handed to ``self.model.load_weights`` as one streaming
    iterable of ``(name, tensor)`` per round. If the target has
    ``validate_update(names, dtypes, shapes)`` it is called before anything is
    received, so a mismatched model is refused before the trainer starts
    streaming. Any receive error leaves the group (so the trainer fails at
    once instead of at its timeout); the trainer then re-initializes.
    """

    init_info_cls = TorchDistWeightTransferInitInfo
    update_info_cls = TorchDistWeightTransferUpdateInfo

    def __init__(self, config: WeightTransferConfig, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: TransferGroup | None = None
        self.init_info: TorchDistWeightTransferInitInfo | None = None
        # Host memory only: receive buffers kept between rounds spare the page
        # faults of fresh memory. Not on a GPU, where they would pin a copy of
        # the model in device memory.
        self._receive_buffers: list[torch.Tensor] | None = [] if device.type == "cpu" else None

    def worker_rank(self, init_info: TorchDistWeightTransferInitInfo) -> int:
        pc = self.parallel_config
        return init_info.rank_offset + getattr(pc, "data_parallel_index", 0) * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: TorchDistWeightTransferInitInfo) -> None:
        self.shutdown()
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
        self.group = TransferGroup.connect(
            store,
            master_address=init_info.master_address,
            rank=rank,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
            transport=init_info.transport,
            device=self.device if init_info.transport == "nccl" else torch.device("cpu"),
        )
        self.init_info = init_info

    def start_weight_update(self) -> None:
        """Nothing to prepare: the reference receiver stages in its target,
        the vLLM plugin adds layerwise reload here."""

    def finish_weight_update(self) -> None:
        """Nothing to finalize (see ``start_weight_update``)."""

    def receive_weights(self, update_info: TorchDistWeightTransferUpdateInfo) -> None:
        if self.group is None or self.init_info is None:
            raise RuntimeError("init_weight_transfer_engine must be called before update_weights")
        validate = getattr(self.model, "validate_update", None)
        if callable(validate):
            try:
                validate(update_info.names, update_info.dtypes, [tuple(s) for s in update_info.shapes])
            except Exception:
                self.shutdown()
                raise
        info, group = self.init_info, self.group
        wait = lambda work: work.wait()  # noqa: E731 - the transport's own timeouts bound it
        metas = list(zip(update_info.dtypes, update_info.shapes))
        if info.packed:
            tensors = receive_packed(
                metas,
                buffer_size_bytes=info.packed_buffer_size_bytes,
                num_buffers=info.packed_num_buffers,
                broadcast=group.broadcast,
                wait=wait,
                device=group.device,
                buffers=self._receive_buffers if group.device.type == "cpu" else None,
            )
        else:
            tensors = self._receive_unpacked(metas)
        weights = zip(update_info.names, tensors)
        try:
            self.model.load_weights(weights)
            for _ in weights:  # what load_weights skipped must still come off the wire
                pass
        except Exception:
            self.shutdown()
            raise

    def _receive_unpacked(self, metas: list[tuple[torch.dtype, list[int]]]) -> Iterator[torch.Tensor]:
        assert self.group is not None
        for dtype, shape in metas:
            tensor = torch.empty(tuple(shape), dtype=dtype, device=self.group.device)
            self.group.broadcast(tensor).wait()
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
