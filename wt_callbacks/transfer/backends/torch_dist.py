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

import atexit
import ctypes
import datetime
import ipaddress
import json
import logging
import os
import queue
import secrets
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
from wt_callbacks.transfer.packing import broadcast_packed, plan_chunks, receive_packed, slot_capacities

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
SHM_DIR = "/dev/shm"
SHM_NAME_PREFIX = "wt_callbacks-ring-"
"""Ring files are ``SHM_DIR/SHM_NAME_PREFIX<random token>``; each exists only
while the ranks map it (rank 0 unlinks it as soon as every rank reported)."""
SHM_SLOTS = 4
SHM_SLOT_BYTES = 4 * 1024 * 1024
"""The ring: ``SHM_SLOTS`` slots of ``SHM_SLOT_BYTES`` (16 MiB in all).

Four slots let the trainer fill one slot while the workers empty the others,
so neither side waits on the other's copy of a single piece; 4 MiB pieces
make the per-piece cost (a few Python calls and one poll) negligible next to
the copy (~1 ms). The ring adds to the trainer's memory on top of the packed
bound (``packed_num_buffers`` x bucket + the largest tensor, with 1.25x
allowance), so it is kept small: 16 MiB is 12% of the default 2 x 64 MiB."""
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 10.0
"""A worker waiting for data fails if the trainer's heartbeat (bumped every
``HEARTBEAT_INTERVAL_S`` by a thread on rank 0) stood still this long: a
killed trainer would otherwise leave the server stuck in ``update_weights``
for ``timeout_s`` (300 s by default), since a dead process sets no abort
flag. 20 missed beats: a trainer whose Python threads starve for 10 s is
treated as dead."""


# --------------------------------------------------------------------------- #
# Typed config and wire dicts
# --------------------------------------------------------------------------- #


def _check_positive(**values: float) -> None:
    for key, value in values.items():
        if value <= 0:
            raise ValueError(f"{key} must be > 0, got {value}")


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
        _check_positive(
            packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            packed_num_buffers=self.packed_num_buffers,
            timeout_s=self.timeout_s,
        )
        if self.dtype is not None:
            wire = dtype_from_name(self.dtype, key="dtype")
            if not wire.is_floating_point:
                raise ValueError(f"dtype={self.dtype!r}: the wire dtype must be a floating-point dtype")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of {TRANSPORTS}")

    @property
    def wire_dtype(self) -> torch.dtype | None:
        return None if self.dtype is None else dtype_from_name(self.dtype)


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
        _check_positive(
            packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            packed_num_buffers=self.packed_num_buffers,
            timeout_s=self.timeout_s,
        )
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


_FENCE_LOCK = threading.Lock()


def _fence() -> None:
    """Order every memory access before this call before every access after it.

    Ring data and the sequence numbers that publish it are plain stores into
    memory another process reads. x86 keeps stores in order (TSO); AArch64
    does not, so without a barrier a worker could see a slot's new sequence
    number before the bytes it publishes (or the trainer see a slot freed
    before the worker finished reading it) and copy stale data. Python has
    no fence instruction; a lock's acquire and release are atomic
    read-modify-writes (glibc: a compare-and-swap with acquire semantics, an
    atomic add with release semantics). On x86 each is a LOCK-prefixed
    instruction, a full barrier. On AArch64 a single acquire/release pair
    lets plain accesses on either side slip into it, but a release followed
    by an acquire stays ordered (ARMv8's acquire/release are RCsc), so two
    rounds order everything before the first release before everything
    after the second acquire.
    """
    for _ in range(2):
        _FENCE_LOCK.acquire()
        _FENCE_LOCK.release()


class _ShmWork:
    """Handle of one ring broadcast, with the two methods callers use
    (``is_completed`` to poll, ``wait`` to collect the outcome), as gloo's
    ``Work``. Errors are ``WeightTransferError`` (a ``RuntimeError``, which
    is what callers of gloo's ``wait`` catch)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self._done = threading.Event()
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> bool:
        # Unbounded here because the streaming thread bounds every wait of a
        # piece (timeout_s, abort flag, heartbeat) and ``close`` fails every
        # work still queued: the event is always set.
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self.tensor = None
        self._done.set()


_ABORT, _HEARTBEAT, _HELLO = 0, 1, 2


def _ring_layout(world_size: int, slots: int, slot_bytes: int) -> tuple[int, int, int]:
    """``(header words, header bytes, file bytes)``: header words are the abort
    flag, the heartbeat, one hello word per rank, per slot its piece's seq and
    length, and per worker per slot its done seq. The header is padded to a
    page so slots start page-aligned."""
    words = 2 + world_size + 2 * slots + (world_size - 1) * slots
    header_bytes = -(-words * 8 // 4096) * 4096
    return words, header_bytes, header_bytes + slots * slot_bytes


class ShmRing:
    """Broadcasts from rank 0 through a ring of slots in shared memory.

    Piece ``seq`` (1, 2, ...: every broadcast cut into pieces of at most
    ``slot_bytes``, in the order the broadcasts were issued, which is the
    same on every rank) travels in slot ``(seq - 1) % slots``. The trainer
    fills that slot once every worker's done word for it reached ``seq -
    slots`` (the piece it held before), then publishes the piece by storing
    ``seq`` in the slot's ready word; a worker waits for that, copies the
    piece out and stores ``seq`` in its own done word. Each word has one
    writer, so plain 8-byte stores suffice, with ``_fence`` ordering them
    against the data they publish or release.

    One thread per rank streams the broadcasts; ``ctypes.memmove`` releases
    the GIL, so the trainer packs its next chunk while its thread copies the
    previous one in, and the workers copy out at the same time. Single-
    threaded copies on purpose: ``torch``'s ``copy_`` would split each piece
    over every intra-op thread, from each calling thread, oversubscribing the
    cores trainer and servers share on one host.

    Every wait polls with a backoff from 20 us to 1 ms (never a hot spin:
    the peer needs the core) and is bounded by ``timeout_s``, by the abort
    flag that ``close`` sets on any rank (so a peer waiting on a rank that
    left fails at once, like gloo's abort), and on the workers by the
    trainer's heartbeat (``HEARTBEAT_TIMEOUT_S``).
    """

    def __init__(self, mem: torch.Tensor, *, rank: int, world_size: int, slots: int, slot_bytes: int,
                 timeout_s: float) -> None:  # fmt: skip
        words, header_bytes, nbytes = _ring_layout(world_size, slots, slot_bytes)
        if mem.numel() != nbytes:
            raise ValueError(f"the ring mapping has {mem.numel()} bytes, the layout needs {nbytes}")
        self.mem = mem  # owns the mapping the raw pointers below point into
        self.rank, self.world_size = rank, world_size
        self.slots, self.slot_bytes = slots, slot_bytes
        self.timeout_s = timeout_s
        self.words = (ctypes.c_int64 * words).from_address(mem.data_ptr())
        self._first_slot = mem.data_ptr() + header_bytes
        self._ready = 2 + world_size
        self._length = self._ready + slots
        self._done = self._length + slots
        self._seq = 0
        self._broken: str | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._jobs: queue.Queue[_ShmWork | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._stream, name=f"wt-shm-rank{rank}", daemon=True)]
        if rank == 0:
            self._threads.append(threading.Thread(target=self._beat, name="wt-shm-heartbeat", daemon=True))

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def broadcast(self, tensor: torch.Tensor) -> _ShmWork:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                f"the shm transport broadcasts contiguous CPU tensors, got a "
                f"{'' if tensor.is_contiguous() else 'non-contiguous '}tensor on {tensor.device}"
            )
        work = _ShmWork(tensor)
        with self._lock:
            if self._closed.is_set():
                work._finish(WeightTransferError("the transfer group was shut down"))
            elif tensor.numel() == 0:
                work._finish()
            else:
                self._jobs.put(work)
        return work

    def close(self) -> None:
        """Set the abort flag, stop the threads, fail every queued broadcast."""
        self.words[_ABORT] = 1
        with self._lock:
            self._closed.set()
            self._jobs.put(None)
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=10)
        while True:
            try:
                work = self._jobs.get_nowait()
            except queue.Empty:
                break
            if work is not None:
                work._finish(WeightTransferError("the transfer group was shut down"))

    def _stream(self) -> None:
        copy = self._send if self.rank == 0 else self._receive
        while (work := self._jobs.get()) is not None:
            if self._closed.is_set() and self._broken is None:
                self._broken = "the transfer group was shut down"
            if self._broken is not None:
                # The stream is out of step after a failed piece: every later
                # broadcast would read or overwrite the wrong bytes.
                work._finish(WeightTransferError(self._broken))
                continue
            try:
                assert work.tensor is not None
                copy(work.tensor)
            except Exception as e:  # noqa: BLE001 - handed to the waiting caller
                self._broken = str(e)
                work._finish(e)
            else:
                work._finish()

    def _pieces(self, tensor: torch.Tensor) -> Iterator[tuple[int, int, int, int]]:
        """``(seq, slot address, tensor address, size)`` of each piece."""
        base, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for offset in range(0, nbytes, self.slot_bytes):
            seq = self._seq + 1
            slot = (seq - 1) % self.slots
            yield seq, slot, base + offset, min(self.slot_bytes, nbytes - offset)
            self._seq = seq

    def _send(self, tensor: torch.Tensor) -> None:
        words = self.words
        for seq, slot, address, size in self._pieces(tensor):
            done = range(self._done + slot, self._done + (self.world_size - 1) * self.slots, self.slots)
            free = seq - self.slots
            self._wait_until(lambda: all(words[i] >= free for i in done), "every worker to free a ring slot")
            ctypes.memmove(self._first_slot + slot * self.slot_bytes, address, size)
            words[self._length + slot] = size
            _fence()
            words[self._ready + slot] = seq

    def _receive(self, tensor: torch.Tensor) -> None:
        words = self.words
        done = self._done + (self.rank - 1) * self.slots
        for seq, slot, address, size in self._pieces(tensor):
            self._wait_until(lambda: words[self._ready + slot] == seq, "the trainer's next piece")
            if words[self._length + slot] != size:
                raise WeightTransferError(
                    f"the trainer sent a piece of {words[self._length + slot]} bytes where this worker "
                    f"expected {size}: trainer and worker disagree on the tensors of the round"
                )
            ctypes.memmove(address, self._first_slot + slot * self.slot_bytes, size)
            _fence()
            words[done + slot] = seq

    def _wait_until(self, ready: Callable[[], bool], what: str) -> None:
        words = self.words
        start = beat_seen = time.monotonic()
        beat = words[_HEARTBEAT]
        pause = 2e-5
        while not ready():
            if self._closed.is_set():
                raise WeightTransferError("the transfer group was shut down")
            if words[_ABORT]:
                raise WeightTransferError(
                    f"another rank left the transfer group (it failed or shut down) while this one "
                    f"waited for {what}"
                )
            now = time.monotonic()
            if self.rank != 0:
                if words[_HEARTBEAT] != beat:
                    beat, beat_seen = words[_HEARTBEAT], now
                elif now - beat_seen > HEARTBEAT_TIMEOUT_S:
                    raise WeightTransferError(
                        f"the trainer's heartbeat stopped for {HEARTBEAT_TIMEOUT_S:g} s while this worker "
                        f"waited for {what}: the trainer process died or hung"
                    )
            if now - start > self.timeout_s:
                raise WeightTransferError(f"waited timeout_s={self.timeout_s:g} for {what}")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        _fence()

    def _beat(self) -> None:
        while not self._closed.wait(HEARTBEAT_INTERVAL_S):
            self.words[_HEARTBEAT] += 1


_RINGS_TO_UNLINK: set[str] = set()
"""Ring files created here and not yet unlinked. A rendezvous the trainer gave
up on (a server refused it) leaves its thread waiting for the workers'
reports, and daemon threads die silently at exit: ``atexit`` unlinks what
they still hold."""


@atexit.register
def _unlink_rings_at_exit() -> None:
    for path in list(_RINGS_TO_UNLINK):
        _unlink_ring(path)


def _unlink_ring(path: str) -> None:
    _RINGS_TO_UNLINK.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _create_ring_file(nbytes: int) -> str:
    path = os.path.join(SHM_DIR, SHM_NAME_PREFIX + secrets.token_hex(16))
    # 0600: only processes of this user may map the ring (a server running as
    # another user reports that it cannot, and the negotiation handles it).
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    _RINGS_TO_UNLINK.add(path)
    try:
        # Reserve the pages now: on a full tmpfs a sparse file turns the
        # first write into it into a SIGBUS instead of an error here.
        os.posix_fallocate(fd, 0, nbytes)
    except BaseException:
        _unlink_ring(path)
        raise
    finally:
        os.close(fd)
    return path


def _map_ring_file(path: str, nbytes: int) -> torch.Tensor:
    # ``torch.from_file(shared=True)`` creates a missing file: a worker with
    # its own /dev/shm would silently map a fresh, private ring (and leave it
    # behind). Opening without O_CREAT first makes that an error.
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size != nbytes:
        raise OSError(f"{path} has {size} bytes, the ring needs {nbytes}")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _shm_unavailable(detail: str) -> str:
    return (
        f"transport='shm' needs every inference worker to map the trainer's shared-memory ring from "
        f"{SHM_DIR}, but {detail}. Run the servers on the trainer's host, as the same user and sharing "
        f"its {SHM_DIR} (a container needs --ipc=host or a shared {SHM_DIR} mount), or set "
        "transport='gloo' (or 'auto', which falls back to gloo)"
    )


def _offer_ring(store: dist.Store, *, world_size: int, timeout_s: float, fallback_to_gloo: bool) -> ShmRing | None:
    """Rank 0 of the negotiation: create and map the ring, publish it, collect
    every worker's report, unlink the file, decide for every rank."""
    _, _, nbytes = _ring_layout(world_size, SHM_SLOTS, SHM_SLOT_BYTES)
    ring, path, problems = None, "", {}
    try:
        path = _create_ring_file(nbytes)
        ring = ShmRing(_map_ring_file(path, nbytes), rank=0, world_size=world_size, slots=SHM_SLOTS,
                       slot_bytes=SHM_SLOT_BYTES, timeout_s=timeout_s)  # fmt: skip
    except (OSError, RuntimeError) as e:
        problems[0] = f"the trainer cannot create it: {type(e).__name__}: {e}"
    try:
        offer = {"path": path if ring is not None else "", "slots": SHM_SLOTS, "slot_bytes": SHM_SLOT_BYTES}
        store.set("shm/ring", json.dumps(offer))
        if ring is not None:
            keys = [f"shm/mapped/{r}" for r in range(1, world_size)]
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
            _fence()
            for r, key in enumerate(keys, start=1):
                report = store.get(key).decode()
                if not report.startswith("hello "):
                    problems[r] = f"rank {r} cannot: {report}"
                elif ring.words[_HELLO + r] != int(report.split()[1]):
                    # The path opened, but a different file: not this memory.
                    problems[r] = f"rank {r} mapped a different file of that name (its own {SHM_DIR}?)"
    finally:
        if path:
            # Every rank mapped the file or gave up: from here on it lives only
            # as long as the mappings, so even a crash leaks nothing.
            _unlink_ring(path)
    decision = {"use": "shm", "message": ""}
    if problems:
        detail = "; ".join(problems[r] for r in sorted(problems))
        if fallback_to_gloo:
            decision["use"] = "gloo"
            logger.warning("torch_dist: shared-memory ring unavailable (%s); every rank uses gloo broadcasts", detail)
        else:
            decision = {"use": "error", "message": _shm_unavailable(detail)}
    store.set("shm/decision", json.dumps(decision))
    return _follow(decision, ring)


def _join_ring(store: dist.Store, *, rank: int, world_size: int, timeout_s: float) -> ShmRing | None:
    """A worker's side of the negotiation: map the offered ring, report, follow rank 0's decision."""
    offer = json.loads(store.get("shm/ring"))
    ring = None
    if offer["path"]:
        try:
            _, _, nbytes = _ring_layout(world_size, offer["slots"], offer["slot_bytes"])
            ring = ShmRing(_map_ring_file(offer["path"], nbytes), rank=rank, world_size=world_size,
                           slots=offer["slots"], slot_bytes=offer["slot_bytes"], timeout_s=timeout_s)  # fmt: skip
            nonce = secrets.randbits(62) + 1
            ring.words[_HELLO + rank] = nonce
            _fence()
            report = f"hello {nonce}"
        except (OSError, RuntimeError, ValueError) as e:
            ring = None
            report = f"{offer['path']}: {type(e).__name__}: {e}"
        store.set(f"shm/mapped/{rank}", report)
    return _follow(json.loads(store.get("shm/decision")), ring)


def _follow(decision: dict[str, str], ring: ShmRing | None) -> ShmRing | None:
    if decision["use"] == "error":
        raise WeightTransferError(decision["message"])
    if decision["use"] == "gloo":
        return None
    assert ring is not None, "rank 0 decided for the ring only if every rank mapped it"
    ring.start()
    return ring


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
                shm = _offer_ring(prefix, world_size=world_size, timeout_s=timeout_s, fallback_to_gloo=fallback_to_gloo)
            else:
                shm = _join_ring(prefix, rank=rank, world_size=world_size, timeout_s=timeout_s)
        except BaseException as e:
            cls(store, pg, rank, world_size, device).destroy()
            if isinstance(e, WeightTransferError):
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
        world_size = init_info.world_size
        if world_size is None:
            get_world_size = getattr(self.client, "get_world_size", None)
            if not callable(get_world_size):
                raise ValueError(
                    "init_info: world_size is missing and the client has no get_world_size() to ask "
                    "the servers; set world_size = 1 + the number of inference workers"
                )
            world_size = 1 + int(get_world_size())
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
        deadline = time.monotonic() + timeout_s + 5
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
