"""The packed broadcast: many tensors per collective, in bounded memory.

One collective per tensor costs a round trip per tensor; one collective for
the whole model costs a full copy of it. Packing cuts the stream into chunks
of about ``buffer_size_bytes`` and broadcasts one flat ``uint8`` buffer per
chunk, rotating over ``num_buffers`` buffers so that packing chunk k+1
(including its FSDP gathers) overlaps the broadcast of chunk k.

The chunk cut rule is vLLM's (``packed_tensor.py``), and both sides derive it
from the same metadata, so they agree without sending boundaries: tensors are
appended in order and the chunk closes right after the tensor that makes the
running total *strictly greater* than the buffer size. A chunk can therefore
exceed the buffer by up to its last tensor; a tensor larger than the buffer
forms (the end of) a chunk of its own.

The functions here are transport-agnostic: they take ``broadcast(tensor) ->
work`` and ``wait(work)`` callables. A transport that can send several
tensors as one message (``broadcast_parts(tensors) -> work``, the shared-
memory ring) gets each chunk's tensors as they are instead: no pack copy.

Casting to the wire dtype happens here too when the sender passes the wire
dtype of every tensor (``dtypes``) and a tensor is in another floating-point
dtype: it is converted as it is copied into the buffer, or handed to the
transport as a ``CastPart`` that the transport converts as it copies it in.
A cast into memory that is already mapped runs at the speed of a copy; a cast
into a fresh temporary (``tensor.to(dtype)``) page-faults it in first and was
5x slower on a CPU (0.23 s vs 0.04 s for 100M fp32 -> bf16).
"""

from __future__ import annotations

import mmap
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from wt_callbacks.transfer.validation import check_positive


class CastPart(NamedTuple):
    """A part of a broadcast whose bytes are those of ``tensor`` converted to
    ``dtype``: the transport casts as it copies (``tensor`` is contiguous).
    Received into, its bytes are values of ``dtype``, converted into ``tensor``."""

    tensor: torch.Tensor
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.dtype.itemsize


Broadcast = Callable[[torch.Tensor], Any]
BroadcastParts = Callable[[list[torch.Tensor | CastPart]], Any]
Wait = Callable[[Any], None]


def plan_chunks(nbytes: Sequence[int], buffer_size_bytes: int) -> list[range]:
    """Index ranges of the chunks for tensors of the given byte sizes."""
    check_positive("packed_buffer_size_bytes", buffer_size_bytes, integer=True)
    chunks: list[range] = []
    start, total = 0, 0
    for i, n in enumerate(nbytes):
        total += n
        if total > buffer_size_bytes:
            chunks.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(nbytes):
        chunks.append(range(start, len(nbytes)))
    return chunks


def slot_capacities(nbytes: Sequence[int], chunks: Sequence[range], num_buffers: int) -> list[int]:
    """Bytes each rotating buffer needs: chunk i travels in buffer ``i % num_buffers``."""
    capacities = [0] * num_buffers
    for i, chunk in enumerate(chunks):
        capacities[i % num_buffers] = max(capacities[i % num_buffers], sum(nbytes[j] for j in chunk))
    return capacities


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a tensor (copying only if it is not contiguous)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def _wire_of(tensor: torch.Tensor, dtypes: Sequence[torch.dtype] | None, index: int) -> torch.dtype:
    return tensor.dtype if dtypes is None else dtypes[index]


def copy_as_wire(dst: torch.Tensor, tensor: torch.Tensor, wire: torch.dtype) -> None:
    """Copy ``tensor`` into the uint8 slice ``dst`` as ``wire`` bytes, converting
    in the same pass. A slice not aligned to ``wire`` (after a tensor of an odd
    byte size) cannot be viewed as it: such a tensor is converted first."""
    if dst.storage_offset() % wire.itemsize == 0:
        dst.view(wire).view(tensor.shape).copy_(tensor)
    else:
        dst.copy_(_as_bytes(tensor.to(wire)))


def broadcast_packed(
    tensors: Iterable[torch.Tensor],
    *,
    buffer_size_bytes: int,
    num_buffers: int,
    broadcast: Broadcast,
    wait: Wait,
    capacity_hint: Sequence[int] | None = None,
    device: torch.device | str = "cpu",
    buffers: list[torch.Tensor] | None = None,
    broadcast_parts: BroadcastParts | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
) -> int:
    """Sender side: pack ``tensors`` into chunks and broadcast each one.

    Each tensor is copied into the current buffer as soon as it is yielded,
    so a gathered FSDP tensor is released before the next gather. Buffers
    rotate; a buffer is refilled only after its previous broadcast completed.
    ``capacity_hint[k]`` sizes buffer k: the largest planned chunk it will
    carry (``slot_capacities``). Returns the number of bytes sent.

    ``buffers``: a list the caller keeps between rounds; buffers found there
    are reused and new ones are stored in it. Fresh host memory costs a page
    fault per 4 KiB on first touch, which on a CPU dominated the round
    (0.17 s per 400 MiB), so reusing them is what makes repeated rounds fast.

    Peak extra memory: the ``num_buffers`` buffers (each at most
    ``buffer_size_bytes`` + the largest tensor) plus the tensor being copied.

    ``broadcast_parts``: when given, each chunk goes out as the list of its
    tensors (same chunks, same bytes on the wire) and no buffer is used;
    see ``stream_parts``.

    ``dtypes``: the wire dtype of every tensor, in order (``None``: each
    tensor's own). A tensor in another dtype is converted as it is copied
    into the buffer (or by the transport, see ``stream_parts``).
    """
    if num_buffers < 1:
        raise ValueError(f"packed_num_buffers must be >= 1, got {num_buffers}")
    if broadcast_parts is not None:
        return stream_parts(
            tensors,
            buffer_size_bytes=buffer_size_bytes,
            num_buffers=num_buffers,
            broadcast_parts=broadcast_parts,
            wait=wait,
            device=device,
            dtypes=dtypes,
        )
    capacities = list(capacity_hint) if capacity_hint else [buffer_size_bytes] * num_buffers
    cache: list[torch.Tensor] = buffers if buffers is not None else []
    in_flight: list[Any] = [None] * num_buffers
    slot, fill, sent = 0, 0, 0

    def current() -> torch.Tensor:
        if in_flight[slot] is not None:
            wait(in_flight[slot])
            in_flight[slot] = None
        capacity = max(capacities[slot], 1)
        if slot >= len(cache):
            cache.append(torch.empty(capacity, dtype=torch.uint8, device=device))
        elif cache[slot].numel() < capacity or cache[slot].device != torch.device(device):
            cache[slot] = torch.empty(capacity, dtype=torch.uint8, device=device)
        return cache[slot]

    def flush() -> None:
        nonlocal slot, fill, sent
        in_flight[slot] = broadcast(cache[slot][:fill])
        sent += fill
        slot, fill = (slot + 1) % num_buffers, 0

    for i, tensor in enumerate(tensors):
        wire = _wire_of(tensor, dtypes, i)
        n = tensor.numel() * wire.itemsize
        buf = current()
        if fill + n > buf.numel():
            # Only without a plan hint (the static older call style): grow the
            # buffer, keeping what is already packed.
            grown = torch.empty(fill + n, dtype=torch.uint8, device=device)
            grown[:fill].copy_(buf[:fill])
            buf = cache[slot] = grown
        if n:
            copy_as_wire(buf[fill : fill + n], tensor, wire)
        fill += n
        del tensor
        if fill > buffer_size_bytes:
            flush()
    if fill:
        flush()
    for work in in_flight:
        if work is not None:
            wait(work)
    return sent


def stream_parts(
    tensors: Iterable[torch.Tensor],
    *,
    buffer_size_bytes: int,
    num_buffers: int,
    broadcast_parts: BroadcastParts,
    wait: Wait,
    device: torch.device | str = "cpu",
    dtypes: Sequence[torch.dtype] | None = None,
) -> int:
    """Sender side without packing: each chunk is broadcast as its tensors.

    Same chunk cut as ``broadcast_packed``, so receivers see the same
    chunks. A chunk's tensors are held until its broadcast completed, and
    at most ``num_buffers`` chunks are held at a time (the one being
    collected included), so the memory bound is that of the buffers; for a
    plain module the tensors are the parameters themselves and cost nothing.
    They are read after they were yielded, hence the ``WeightSource``
    contract that a yielded tensor stays unchanged until the round ends.
    Tensors not on ``device`` (a GPU trainer sending through the host ring)
    are copied there first (in the wire dtype). A tensor on ``device`` in
    another dtype than its wire dtype (``dtypes``) goes as a ``CastPart``:
    the transport converts it as it copies it in, with no temporary. Returns
    the number of bytes sent.
    """
    in_flight: deque[Any] = deque()
    parts: list[torch.Tensor | CastPart] = []
    fill = sent = 0
    for i, tensor in enumerate(tensors):
        wire = _wire_of(tensor, dtypes, i)
        part: torch.Tensor | CastPart
        if tensor.dtype == wire:
            part = _as_bytes(tensor.to(device))
        elif tensor.device == torch.device(device) and tensor.is_contiguous() and fill % wire.itemsize == 0:
            part = CastPart(tensor, wire)
        else:
            # Off the host, not contiguous, or at an offset not aligned to the
            # wire dtype (after a tensor of an odd byte size): convert first.
            part = _as_bytes(tensor.to(device=device, dtype=wire))
        parts.append(part)
        fill += part.nbytes if isinstance(part, CastPart) else part.numel()
        del part, tensor
        if fill > buffer_size_bytes:
            in_flight.append(broadcast_parts(parts))
            sent += fill
            parts, fill = [], 0
            if len(in_flight) >= num_buffers:
                wait(in_flight.popleft())
    if fill:  # a rest of zero-size tensors only is not sent, as in broadcast_packed
        in_flight.append(broadcast_parts(parts))
        sent += fill
    while in_flight:
        wait(in_flight.popleft())
    return sent


def receive_packed(
    metas: Sequence[tuple[torch.dtype, Sequence[int]]],
    *,
    buffer_size_bytes: int,
    num_buffers: int,
    broadcast: Broadcast,
    wait: Wait,
    device: torch.device | str = "cpu",
    buffers: list[torch.Tensor] | None = None,
    loader_copies: bool = False,
    destinations: Sequence[torch.Tensor | None] | None = None,
    receive_parts: BroadcastParts | None = None,
    mapped: bool = False,
) -> Iterator[torch.Tensor]:
    """Receiver side: yield one tensor per ``(dtype, shape)`` in order.

    Receives of the next ``num_buffers - 1`` chunks are posted before the
    current chunk is handed out, so unpacking/loading chunk k overlaps the
    transfer of chunk k+1. The yielded tensors are views into the chunk's
    buffer. By default each chunk of a round gets its own buffer: a loader
    may keep the views until the round finishes (vLLM's layerwise reload
    holds a layer's tensors until the layer is complete) without the next
    chunk overwriting them.

    ``loader_copies``: the loader is done with a chunk's tensors once it asks
    for the next chunk's first one (it copies what it keeps). The buffers
    then rotate over ``num_buffers + 1``: chunk k+num_buffers is posted into
    chunk k-1's, so receive memory is bounded like the sender's instead of
    growing to the whole round.

    ``buffers``: a cache the caller keeps between rounds (per chunk, or per
    rotating slot with ``loader_copies``), reused when big enough; it saves
    the page faults of fresh host memory, at the cost of keeping the buffers.
    Without ``loader_copies`` it is only for hosts where the round's loader
    is done with the views once the round finished.

    ``destinations``: per tensor, where the loader wants it (contiguous, of
    its shape; of its dtype, or of another floating-point one to convert it
    into) or ``None``; with a transport that can receive one broadcast into
    several tensors (``receive_parts``, the shm ring), a chunk whose every
    tensor has one is received straight into them (converting as it copies)
    and they are what is yielded: one copy fewer than through a buffer. A
    tensor to convert must sit at an offset of its chunk aligned to its
    dtype; a chunk where one does not comes in a buffer.

    ``mapped``: each chunk comes in anonymous memory mapped for it alone
    (``buffers`` is emptied and not used), which the OS takes back the moment
    the loader dropped its last view of the chunk, where a heap that keeps
    freed memory (a vLLM worker's) would keep it.
    """
    sizes = [_numel(shape) * dtype.itemsize for dtype, shape in metas]
    chunks = plan_chunks(sizes, buffer_size_bytes)
    chunk_bytes = [sum(sizes[i] for i in chunk) for chunk in chunks]
    slots = max(num_buffers, 1) + 1 if loader_copies else len(chunks)
    capacities = slot_capacities(sizes, chunks, slots)
    cache = None if mapped else buffers
    if buffers is not None:
        del buffers[0 if mapped else slots :]  # what a larger (or a mapped) round does not use
    pending: list[tuple[range, torch.Tensor | list[torch.Tensor], Any]] = []
    next_chunk = 0

    def direct(chunk: range) -> tuple[list[torch.Tensor], list[torch.Tensor | CastPart]] | None:
        """The chunk's destinations and the parts to receive into, if it can go straight into them."""
        if receive_parts is None or destinations is None:
            return None
        into: list[torch.Tensor] = []
        parts: list[torch.Tensor | CastPart] = []
        offset = 0
        for i in chunk:
            dest, wire = destinations[i], metas[i][0]
            if dest is None:
                return None
            if dest.dtype == wire:
                parts.append(_as_bytes(dest))
            elif offset % wire.itemsize == 0:
                parts.append(CastPart(dest, wire))
            else:
                return None
            into.append(dest)
            offset += sizes[i]
        return into, parts

    def post() -> None:
        nonlocal next_chunk
        chunk = chunks[next_chunk]
        found = direct(chunk)
        if found is not None:
            assert receive_parts is not None
            into, parts = found
            pending.append((chunk, into, receive_parts(parts) if chunk_bytes[next_chunk] else None))
            next_chunk += 1
            return
        slot, size = next_chunk % slots, chunk_bytes[next_chunk]
        if mapped and size:
            # A tensor over a mapping keeps the mapping object, which unmaps
            # when the tensor's storage goes.
            buf = torch.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
        elif cache is not None and slot < len(cache) and cache[slot].numel() >= capacities[slot]:
            buf = cache[slot]
        else:
            buf = torch.empty(capacities[slot], dtype=torch.uint8, device=device)
            if cache is not None:
                # Slot i is cache[i] even when earlier slots went unused (their
                # chunks were received straight into their destinations).
                cache.extend(torch.empty(0, dtype=torch.uint8) for _ in range(slot + 1 - len(cache)))
                cache[slot] = buf
        buf = buf[:size]
        # The sender never sends an empty chunk (only zero-size tensors).
        pending.append((chunk, buf, broadcast(buf) if size else None))
        next_chunk += 1

    while next_chunk < len(chunks) and len(pending) < max(num_buffers, 1):
        post()
    while pending:
        chunk, buf, work = pending.pop(0)
        if work is not None:
            wait(work)
        if next_chunk < len(chunks):
            post()
        if isinstance(buf, list):
            yield from buf
            continue
        offset = 0
        for i in chunk:
            dtype, shape = metas[i]
            yield unpack(buf[offset : offset + sizes[i]], dtype, shape)
            offset += sizes[i]


def unpack(data: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """View a uint8 slice as ``dtype``/``shape`` (copied when misaligned)."""
    if data.storage_offset() % dtype.itemsize:
        data = data.clone()
    return data.view(dtype).view(tuple(shape))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
