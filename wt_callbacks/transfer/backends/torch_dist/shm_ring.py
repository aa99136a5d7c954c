"""Shared-memory ring: the ``shm`` transport of ``torch_dist`` on one host.

Loopback TCP is CPU-bound: the kernel copies every byte on send and again on
receive, and those copies compete with packing and loading for the same
cores (measured here at 47% of the raw TCP ceiling). Through a ring of slots
in ``/dev/shm`` a byte is copied once into shared memory by the trainer and
once out of it by each worker, on both sides in parallel. A worker can reach
a loopback ``master_address`` only from the trainer's host, which is when
``transport="auto"`` offers the ring.

``ShmRing`` streams the broadcasts through a mapped ring; the file it maps is
``shm_files``', and whether a group uses it is decided in
``shm_negotiation``.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections.abc import Callable, Iterator

import torch

from wt_callbacks.transfer.backends.torch_dist.trainer_process import EXIT_CHECK_INTERVAL_S, TrainerProcess
from wt_callbacks.transfer.base import WeightTransferError
from wt_callbacks.transfer.packing import CastPart

SHM_SLOTS = 4
SHM_SLOT_BYTES = 4 * 1024 * 1024
"""The ring: ``SHM_SLOTS`` slots of ``SHM_SLOT_BYTES`` (16 MiB in all).

Four slots let the trainer fill one slot while the workers empty the others,
so neither side waits on the other's copy of a single piece; 4 MiB pieces
make the per-piece cost (a few Python calls and one poll) negligible next to
the copy (~1 ms). On the trainer the ring replaces the pack buffers (chunks
are streamed from the tensors themselves), so it is the transport's whole
memory cost; small against the default 2 x 64 MiB buffers it replaces."""
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 10.0
"""A worker waiting for data fails if the trainer's heartbeat (bumped every
``HEARTBEAT_INTERVAL_S`` by a thread on rank 0) stood still this long: a
killed trainer would otherwise leave the server stuck in ``update_weights``
for ``timeout_s`` (300 s by default), since a dead process sets no abort
flag. 20 missed beats: a trainer whose Python threads starve for 10 s is
treated as dead."""


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


def _use_one_intra_op_thread() -> None:
    """Run this thread's torch ops on one intra-op thread, leaving the rest
    of the process as it was.

    ``torch.set_num_threads(1)`` would also store 1 as the process's default,
    which every thread adopts at its first parallel op: a trainer's main
    thread that had not run one yet, and every thread started later (data
    loading, a server's request handlers), would then run single-threaded
    for good. OpenMP's own setting is per thread, so set that alone, after
    torch initialized this thread (``get_num_threads``), which would
    otherwise overwrite it with the default at this thread's first parallel
    op. Without an OpenMP runtime in the process, casts keep torch's default
    and are only slower."""
    torch.get_num_threads()
    try:
        set_omp_threads = ctypes.CDLL(None).omp_set_num_threads
    except AttributeError:
        return
    set_omp_threads(1)


class _ShmWork:
    """Handle of one ring broadcast, with the two methods callers use
    (``is_completed`` to poll, ``wait`` to collect the outcome), as gloo's
    ``Work``. Errors are ``WeightTransferError`` (a ``RuntimeError``, which
    is what callers of gloo's ``wait`` catch)."""

    def __init__(self, parts: list[torch.Tensor | CastPart]) -> None:
        # Kept until the stream is done with them: the caller may drop its
        # own references (a gathered FSDP tensor) right after issuing.
        self.parts: list[torch.Tensor | CastPart] | None = parts
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
        self.parts = None
        self._done.set()


_ABORT, _HEARTBEAT, _HELLO = 0, 1, 2
"""Header words: the abort flag, the heartbeat, then one hello word per rank
(``write_hello``)."""

_Segment = tuple[int | CastPart, int, int]


def _nbytes(part: torch.Tensor | CastPart) -> int:
    return part.nbytes if isinstance(part, CastPart) else part.numel() * part.element_size()


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
    cores trainer and servers share on one host. A ``CastPart`` (a tensor to
    send in another dtype) is converted by ``copy_`` straight into the slot,
    on this thread alone: the one copy, converting.

    Every wait polls with a backoff from 20 us to 1 ms (never a hot spin:
    the peer needs the core) and is bounded by ``timeout_s``, by the abort
    flag that ``close`` sets on any rank (so a peer waiting on a rank that
    left fails at once, like gloo's abort), and on the workers by the
    trainer's heartbeat (``HEARTBEAT_TIMEOUT_S``) and, where a worker can
    see it (``trainer``), by the trainer process's exit.
    """

    def __init__(self, mem: torch.Tensor, *, rank: int, world_size: int, slots: int, slot_bytes: int,
                 timeout_s: float, trainer: TrainerProcess | None = None) -> None:  # fmt: skip
        words, header_bytes, nbytes = _ring_layout(world_size, slots, slot_bytes)
        if mem.numel() != nbytes:
            raise ValueError(f"the ring mapping has {mem.numel()} bytes, the layout needs {nbytes}")
        self.mem = mem  # owns the mapping the raw pointers below point into
        self.rank, self.world_size = rank, world_size
        self.slots, self.slot_bytes = slots, slot_bytes
        self.timeout_s = timeout_s
        self.trainer = trainer
        self.words = (ctypes.c_int64 * words).from_address(mem.data_ptr())
        self._header_bytes = header_bytes
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

    @staticmethod
    def file_bytes(world_size: int, slots: int, slot_bytes: int) -> int:
        """Bytes of the file a ring of this layout maps."""
        return _ring_layout(world_size, slots, slot_bytes)[2]

    def write_hello(self, nonce: int) -> None:
        """Publish this rank's ``nonce``: read back by rank 0 (``hello``), it
        proves this rank mapped the same memory, not a file of the same name
        in a ``/dev/shm`` of its own."""
        self.words[_HELLO + self.rank] = nonce
        _fence()

    def hello(self, rank: int) -> int:
        """The nonce ``rank`` wrote, once its report says it did."""
        _fence()
        return self.words[_HELLO + rank]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def broadcast(self, tensor: torch.Tensor) -> _ShmWork:
        return self.broadcast_parts([tensor])

    def broadcast_parts(self, parts: list[torch.Tensor | CastPart]) -> _ShmWork:
        """One broadcast whose bytes are those of ``parts``, back to back.

        The receivers cannot tell it from a broadcast of one tensor holding
        the concatenation, so the trainer can send a packed chunk without
        packing it: the ring copies straight from the parameters, and a
        byte is copied once on the trainer instead of twice. A ``CastPart``
        contributes its tensor's values in its dtype; it must start at an
        offset of the broadcast aligned to that dtype's size. On a worker the
        parts are where the bytes land, and a ``CastPart`` takes them as
        values of its dtype, converted into its tensor's.
        """
        for part in parts:
            tensor = part.tensor if isinstance(part, CastPart) else part
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError(
                    f"the shm transport broadcasts contiguous CPU tensors, got a "
                    f"{'' if tensor.is_contiguous() else 'non-contiguous '}tensor on {tensor.device}"
                )
        work = _ShmWork(parts)
        with self._lock:
            if self._closed.is_set():
                work._finish(WeightTransferError("the transfer group was shut down"))
            elif all(_nbytes(part) == 0 for part in parts):
                work._finish()
            else:
                self._jobs.put(work)
        return work

    def close(self) -> None:
        """Set the abort flag, stop the threads, fail every queued broadcast."""
        with self._lock:
            # Closed before the abort flag: this rank's own thread must report
            # its shutdown, not "another rank left".
            self._closed.set()
            self._jobs.put(None)
        self.words[_ABORT] = 1
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=10)
        stopped = False
        while True:
            try:
                work = self._jobs.get_nowait()
            except queue.Empty:
                break
            if work is None:
                stopped = True
            else:
                work._finish(WeightTransferError("the transfer group was shut down"))
        if stopped:  # a thread still alive after its join must still find its sentinel
            self._jobs.put(None)

    def _stream(self) -> None:
        # The casts of CastParts stay on this thread whatever the trainer set:
        # with 2 intra-op threads, casting 200 MB in 4 MiB pieces took
        # 0.13-0.19 s instead of 0.03 s on a loaded 2-core host (a thread team
        # woken per piece).
        _use_one_intra_op_thread()
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
                assert work.parts is not None
                copy(work.parts)
            except Exception as e:  # noqa: BLE001 - handed to the waiting caller
                self._broken = str(e)
                work._finish(e)
            else:
                work._finish()

    def _pieces(self, parts: list[torch.Tensor | CastPart]) -> Iterator[tuple[int, int, int, list[_Segment]]]:
        """``(seq, slot, piece size, segments)`` of each piece of the parts'
        bytes taken as one stream cut every ``slot_bytes``; a segment is
        ``(source, offset in the slot, size)``, the source a part address or,
        for a ``CastPart``, the ``CastPart`` of the elements it holds. The cut
        depends only on the total, so a sender's many parts and a receiver's
        one buffer agree on every piece."""
        segments: list[_Segment] = []
        fill = 0
        for part in parts:
            nbytes = _nbytes(part)
            offset = 0
            while offset < nbytes:
                size = min(self.slot_bytes - fill, nbytes - offset)
                if isinstance(part, CastPart):
                    itemsize = part.dtype.itemsize
                    if fill % itemsize or size % itemsize:
                        raise ValueError("a CastPart must start at an offset aligned to its dtype's size")
                    flat = part.tensor.view(-1)[offset // itemsize : (offset + size) // itemsize]
                    segments.append((CastPart(flat, part.dtype), fill, size))
                else:
                    segments.append((part.data_ptr() + offset, fill, size))
                fill += size
                offset += size
                if fill == self.slot_bytes:
                    yield from self._piece(segments, fill)
                    segments, fill = [], 0
        if fill:
            yield from self._piece(segments, fill)

    def _piece(self, segments: list[_Segment], size: int) -> Iterator[tuple[int, int, int, list[_Segment]]]:
        seq = self._seq + 1
        yield seq, (seq - 1) % self.slots, size, segments
        self._seq = seq

    def _send(self, parts: list[torch.Tensor | CastPart]) -> None:
        words = self.words
        for seq, slot, size, segments in self._pieces(parts):
            done = range(self._done + slot, self._done + (self.world_size - 1) * self.slots, self.slots)
            free = seq - self.slots
            self._wait_until(lambda: all(words[i] >= free for i in done), "every worker to free a ring slot")
            slot_address = self._first_slot + slot * self.slot_bytes
            for source, offset, n in segments:
                if isinstance(source, CastPart):
                    start = self._header_bytes + slot * self.slot_bytes + offset
                    self.mem[start : start + n].view(source.dtype).copy_(source.tensor)
                else:
                    ctypes.memmove(slot_address + offset, source, n)
            words[self._length + slot] = size
            _fence()
            words[self._ready + slot] = seq

    def _receive(self, parts: list[torch.Tensor | CastPart]) -> None:
        words = self.words
        done = self._done + (self.rank - 1) * self.slots
        for seq, slot, size, segments in self._pieces(parts):
            self._wait_until(lambda: words[self._ready + slot] == seq, "the trainer's next piece")
            if words[self._length + slot] != size:
                raise WeightTransferError(
                    f"the trainer sent a piece of {words[self._length + slot]} bytes where this worker "
                    f"expected {size}: trainer and worker disagree on the tensors of the round"
                )
            slot_address = self._first_slot + slot * self.slot_bytes
            for source, offset, n in segments:
                if isinstance(source, CastPart):
                    start = self._header_bytes + slot * self.slot_bytes + offset
                    source.tensor.copy_(self.mem[start : start + n].view(source.dtype))
                else:
                    ctypes.memmove(source, slot_address + offset, n)
            _fence()
            words[done + slot] = seq

    def _wait_until(self, ready: Callable[[], bool], what: str) -> None:
        words = self.words
        start = beat_seen = checked = time.monotonic()
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
                if self.trainer is not None and now - checked > EXIT_CHECK_INTERVAL_S:
                    checked = now
                    if self.trainer.exited():
                        raise WeightTransferError(
                            f"the trainer process (pid {self.trainer.pid}) exited while this worker waited for {what}"
                        )
            if now - start > self.timeout_s:
                raise WeightTransferError(f"waited timeout_s={self.timeout_s:g} for {what}")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        _fence()

    def _beat(self) -> None:
        while not self._closed.wait(HEARTBEAT_INTERVAL_S):
            self.words[_HEARTBEAT] += 1
