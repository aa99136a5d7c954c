"""``HostSnapshot``: one round's sent tensors, held in host memory, in wire dtype and wire layout.

``send: async`` takes it in the training loop and sends it from a background
thread, so the training step that comes next can change the parameters
while the servers still receive the old ones. Taking it is the lockstep part
of a round: every trainer rank iterates the source in the same order (the
FSDP / ZeRO-3 gathers are collectives), the sending rank copies each tensor
into the snapshot as it comes, cast to the wire dtype in the copy, and the
other ranks only join the gathers (``WeightSource.gather_only``).

The layout is the packed wire's: the tensors back to back, in metadata
order, in one flat buffer, so a packed chunk (``packing.plan_chunks``) is a
slice of it and the sender broadcasts the slices as they are, with no pack
copy (``chunks``). The buffer is allocated once and kept, like the pack
buffers it replaces: it is the only extra memory ``send: async`` costs, one
copy of the sent tensors in the wire dtype, on the sending rank only. It is
page-locked (pinned) when the parameters are on a GPU, so the copy out of
device memory runs at the bus's speed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from wt_callbacks.transfer.weight_source import Metadata, ParamMeta, WeightSource, drain, source_metadata
from wt_callbacks.transfer.packing import copy_as_wire, plan_chunks, unpack
from wt_callbacks.transfer.validation import checked_stream

MEMINFO = "/proc/meminfo"


def available_host_bytes() -> int | None:
    """Host memory the kernel can give this process without swapping
    (``MemAvailable``), or ``None`` where it does not say (not Linux)."""
    try:
        with open(MEMINFO) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class HostSnapshot(WeightSource):
    """A ``WeightSource`` that serves the tensors ``capture`` last copied from ``source``.

    Args:
        source: what to snapshot, yielding the wire dtype already
            (``source.with_wire_dtype(dtype)``).
        pin_memory: allocate the buffer page-locked (the parameters are on a GPU).

    ``metadata()``, ``kept_metadata()`` and iteration describe the last capture: iteration yields
    views into the buffer (no gather, no copy), valid until the next
    capture. ``required_bytes()`` is what the buffer will take.
    """

    def __init__(self, source: WeightSource, *, pin_memory: bool = False) -> None:
        self.source = source
        self.pin_memory = pin_memory
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._metas: list[ParamMeta] = []  # of the last capture that completed
        self._kept: list[ParamMeta] = []  # what that capture's round leaves as the servers hold it
        self._offsets: list[int] = []

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds now (0 before the first capture)."""
        return self._buffer.numel()

    def required_bytes(self) -> int:
        """Bytes a capture needs: every sent tensor in its wire dtype (no gather)."""
        return sum(m.nbytes for m in source_metadata(self.source))

    def capture(self, *, is_sender: bool = True) -> float:
        """One pass of the source into the buffer; returns the seconds spent
        waiting for the source's tensors (its gathers and casts).

        Call on every trainer rank, in lockstep: a rank that does not send
        (``is_sender=False``) only joins the gathers. A tensor that disagrees
        with the metadata fails the capture; the sending rank then still
        finishes the pass, so the other ranks' gathers complete.
        """
        metas = source_metadata(self.source)  # on every rank: a source it refuses, every rank refuses alike
        if not is_sender:
            return _timed_pass(self.source.gather_only())
        self._allocate(metas)
        items = self.source.iter_uncast()
        waited, i = 0.0, 0
        try:
            stream = checked_stream(items, metas)
            while True:
                t0 = time.perf_counter()
                tensor = next(stream, None)
                waited += time.perf_counter() - t0
                if tensor is None:
                    break
                start = self._offsets[i]
                copy_as_wire(self._buffer[start : start + metas[i].nbytes], tensor, metas[i].dtype)
                i += 1
        except BaseException:
            # Whatever the buffer holds is no round: a later send must not stream it.
            self._metas = []
            drain(items)
            raise
        if self._buffer.is_pinned() and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._metas = metas
        self._kept = self.source.kept_metadata()
        return waited

    def _allocate(self, metas: list[ParamMeta]) -> None:
        self._offsets = []
        offset = 0
        for m in metas:
            self._offsets.append(offset)
            offset += m.nbytes
        # Rounds that keep frozen tensors are smaller than a connection's
        # first: the largest one's buffer stays, rather than a new one (pinned,
        # several GB) inside the training's stall whenever the size changes.
        if self._buffer.numel() < offset or self._buffer.is_pinned() != self.pin_memory:
            self._buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=self.pin_memory)
        self._metas = []

    def metadata(self) -> Metadata:  # type: ignore[override]
        return Metadata(self._metas)

    def kept_metadata(self) -> list[ParamMeta]:
        return list(self._kept)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for m, start in zip(self._metas, self._offsets):
            yield m.name, unpack(self._buffer[start : start + m.nbytes], m.dtype, m.shape)

    def chunks(self, buffer_size_bytes: int) -> list[torch.Tensor]:
        """The packed chunks of the last capture (the cut rule of ``plan_chunks``), as flat byte slices."""
        sizes = [m.nbytes for m in self._metas]
        out = []
        for chunk in plan_chunks(sizes, buffer_size_bytes):
            start = self._offsets[chunk.start]
            out.append(self._buffer[start : start + sum(sizes[i] for i in chunk)])
        return out

    def with_wire_dtype(self, dtype: torch.dtype | None) -> WeightSource:
        """Itself: it holds the wire dtype its source yields; another one is refused."""
        wrong = [m.name for m in source_metadata(self.source) if m.dtype.is_floating_point and dtype not in (None, m.dtype)]
        if wrong:
            raise ValueError(f"a host snapshot holds its source's wire dtype; {wrong[0]!r} is not {dtype}")
        return self


def _timed_pass(names: Iterator[str]) -> float:
    start = time.perf_counter()
    for _ in names:
        pass
    return time.perf_counter() - start
