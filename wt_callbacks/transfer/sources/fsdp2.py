"""FSDP2 (``fully_shard``) parameters gathered a bucket at a time, at the group's raw rate.

``DTensor.full_tensor()`` per parameter runs one all-gather per tensor and,
around it, DTensor's own allocations and copies (and, for uneven shards, a
pad and an unpad). On 2 gloo ranks that ran at less than half the rate of
``all_gather_into_tensor`` on the same shards. ``FSDP2Shards`` packs the
local shards of a bucket of ``Shard(0)`` parameters into one flat buffer,
casting each to the wire dtype as it copies it (so a bf16 wire gathers half
the bytes), gathers the bucket with one all-gather over the mesh
dimension's group, and cuts the full tensors out of the result.

Uneven shards follow DTensor's ``Shard(0)`` rule (``torch.chunk``: rank ``r``
holds rows ``[r*c, min((r+1)*c, n))`` with ``c = ceil(n / world)``, possibly
none): every rank's part has room for ``c`` rows of each tensor, the unused
rows are padding nobody reads. A tensor larger than a bucket is gathered in
pieces of rows (see ``DEFAULT_GATHER_BUCKET_BYTES``). Other placements
(``Shard(d)`` for ``d > 0``, strided shards of FSDP2 + TP, ``Partial``,
several sharded mesh dimensions) fall back to ``full_tensor()`` of the cast
local shard, in stream order; parameters that are not ``DTensor`` s are
cast and passed through.

Every rank iterates the same names in the same order (the
``ParameterGather`` contract): bucket boundaries depend only on global
shapes, dtypes and placements, which all ranks share, so every rank issues
the same collectives.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from wt_callbacks.lora.merge import Merge
from wt_callbacks.transfer.weight_source import ParamMeta, materialize_full_tensor
from wt_callbacks.transfer.sources.gathering import ParameterGather, in_wire_dtype
from wt_callbacks.transfer.validation import check_positive

DEFAULT_GATHER_BUCKET_BYTES = 4 * 1024 * 1024
"""Full (gathered) bytes per all-gather. On 2 gloo ranks over loopback an
all-gather moves 0.96 GB/s with 4-8 MiB outputs, 0.55 at 1 MiB and 0.32 at
64 MiB (the copies through the kernel stay in cache for small messages), and
a 4 MiB bucket is still in cache when its tensors are cut out of it; larger
tensors are gathered in pieces of rows. NCCL peaks at larger messages: on
GPUs a larger ``bucket_bytes`` is likely better (not measured here)."""
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""torch 2.13 renamed ``all_gather_into_tensor`` (now deprecated, with a warning per call)."""
_ALIGN = 64
"""Each piece's place in a rank's part starts at a multiple of this many
bytes, so every place can be viewed as any dtype."""


class _Sharded:
    """One ``Shard(0)`` parameter being gathered: its local shard and its full tensor."""

    def __init__(self, name: str, tensor: torch.Tensor, dtype: torch.dtype, world: int, coordinate: int) -> None:
        self.name = name
        self.coordinate = coordinate  # this rank's index along the sharded mesh dimension
        with torch.no_grad():
            self.local = tensor.to_local()
        self.shape = tuple(tensor.shape)
        self.dtype = dtype
        self.world = world
        self.rows_per_rank = -(-self.shape[0] // world)
        row = 1
        for d in self.shape[1:]:
            row *= d
        self.row_bytes = row * dtype.itemsize
        self.full: torch.Tensor | None = None

    def rows_of(self, rank: int) -> int:
        """Rows of the shard of ``rank`` (the ``torch.chunk`` rule: the last ranks may hold fewer or none)."""
        return max(0, min(self.rows_per_rank, self.shape[0] - rank * self.rows_per_rank))


@dataclass(frozen=True)
class _Piece:
    """Rows ``[first, end)`` of every rank's shard of ``param``, at ``offset`` in each rank's part."""

    param: _Sharded
    first: int
    end: int
    offset: int
    last: bool  # the param's last piece: once it is gathered the full tensor is complete


def _gather_plan(tensor: torch.Tensor, cache: dict[Any, Any]) -> tuple[Any, int, int] | None:
    """``(group, world, this rank's coordinate)`` for a DTensor sharded on dim
    0 over one mesh dimension (others replicated) whose local shard is the
    one the ``Shard(0)`` rule gives; ``None`` for anything else. ``cache``
    keeps the mesh lookups per (mesh, placements) for the next tensors."""
    placements = getattr(tensor, "placements", None)
    if placements is None or tensor.dim() == 0:
        return None
    key = (tensor.device_mesh, placements)
    if key not in cache:
        from torch.distributed.tensor import Replicate, Shard

        sharded = [i for i, p in enumerate(placements) if type(p) is Shard and p.dim == 0]
        if len(sharded) != 1 or not all(isinstance(p, Replicate) for i, p in enumerate(placements) if i != sharded[0]):
            cache[key] = None
        else:
            mesh, dim = tensor.device_mesh, sharded[0]
            cache[key] = (mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim))
    plan = cache[key]
    if plan is None:
        return None
    _, world, coordinate = plan
    rows = tensor.shape[0]
    chunk = -(-rows // world)
    local_rows = max(0, min(chunk, rows - coordinate * chunk))
    with torch.no_grad():
        local_shape = tuple(tensor.to_local().shape)
    return plan if local_shape == (local_rows, *tensor.shape[1:]) else None


@dataclass
class _Bucket:
    """Pieces gathered by one all-gather over ``group``."""

    group: Any
    device: torch.device
    world: int
    pieces: list[_Piece] = field(default_factory=list)
    part_bytes: int = 0


@dataclass
class _Posted:
    """A bucket whose all-gather is in flight into ``out``."""

    bucket: _Bucket
    out: torch.Tensor
    work: Any
    direct: bool = False  # ``out`` is the storage of the bucket's one full tensor


class FSDP2Shards(ParameterGather):
    """FSDP2 ``DTensor`` parameters (and any plain ones beside them), one all-gather per bucket.

    Each yielded tensor is its own allocation: it stays valid after later
    ones were yielded, as ``ParameterGather`` requires.

    Buckets are pipelined: bucket k+1 is packed and its all-gather posted
    before bucket k is cut out and its tensors yielded, so the copies on
    this rank (and whatever the consumer does with the tensors) overlap the
    collective.

    Memory: two buckets of about ``bucket_bytes`` full bytes are in flight
    at a time, each in a scratch buffer of that size plus this rank's part
    (``1 / world`` of it), and a parameter's full tensor exists from its
    first piece on; on CPU the scratch buffers are kept between rounds
    (fresh host memory is page-faulted on first touch, which costs more
    than the copy into it).

    Args:
        module: the module whose parameters are gathered.
        bucket_bytes: full bytes gathered per all-gather.
        sharded_root: the module as the framework holds it, when ``module``
            is a part of it (its ``fully_shard`` groups may own some of
            ``module``'s parameters); default ``module``.
    """

    scheme = "fsdp2"

    def __init__(
        self,
        module: torch.nn.Module,
        bucket_bytes: int = DEFAULT_GATHER_BUCKET_BYTES,
        sharded_root: torch.nn.Module | None = None,
    ) -> None:
        super().__init__(module)
        check_positive("bucket_bytes", bucket_bytes, integer=True)
        self.bucket_bytes = bucket_bytes
        self.sharded_root = sharded_root if sharded_root is not None else module
        self._scratch: dict[tuple[str, int, torch.device], torch.Tensor] = {}
        self._mesh_groups: dict[Any, Any] = {}

    def _resharded(self) -> None:
        """After a forward without a backward under ``reshard_after_forward=False``
        (Lightning's validation just before ``on_train_epoch_end``), FSDP2
        leaves its unsharded parameters registered: plain tensors, and under
        a ``MixedPrecisionPolicy`` the ``param_dtype`` compute copies, not the
        weights. ``reshard()`` registers the sharded ``DTensor`` s again
        (local, no communication; the next forward gathers as it would have
        after a backward)."""
        from torch.distributed.fsdp import FSDPModule

        for sub in self.sharded_root.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()

    def parameters(self) -> list[ParamMeta]:
        self._resharded()
        # A DTensor's shape and dtype are the global ones: no communication.
        return [ParamMeta(name, p.dtype, tuple(p.shape)) for name, p in self.module.named_parameters()]

    def gather(self, names: Sequence[str], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        return self._pass(names, dtype, keep=True)  # type: ignore[return-value]

    def gather_only(self, names: Sequence[str], dtype: torch.dtype | None) -> Iterator[str]:
        """The same all-gathers, into the scratch buffers only: no full
        tensor is allocated and nothing is cut out of a gathered bucket."""
        return (name for name, _ in self._pass(names, dtype, keep=False))

    def _pass(
        self, names: Sequence[str], dtype: torch.dtype | None, *, keep: bool
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``gather``'s pass; with ``keep`` false the buckets' tensors are yielded as ``None``."""
        self._resharded()
        posted: _Posted | None = None
        parity = 0
        try:
            for item in self._plan(names, dtype):
                if isinstance(item, _Bucket):
                    newer = self._post(item, parity, keep)
                    parity ^= 1
                    if posted is not None:
                        yield from self._unpack(posted, keep)
                    posted = newer
                    continue
                if posted is not None:
                    yield from self._unpack(posted, keep)
                    posted = None
                name, tensor = item
                tensor = in_wire_dtype(tensor, dtype)
                full_tensor = getattr(tensor, "full_tensor", None)
                yield name, tensor if full_tensor is None else full_tensor()
            if posted is not None:
                yield from self._unpack(posted, keep)
                posted = None
        finally:
            # Abandoned mid-round: the collective still writes into a scratch
            # buffer the next round reuses. Bounded by the group's timeout.
            if posted is not None:
                posted.work.wait()

    def _plan(
        self, names: Sequence[str], dtype: torch.dtype | None
    ) -> Iterator[_Bucket | tuple[str, torch.Tensor]]:
        """Buckets of pieces, and the pairs that are not gathered in buckets, in stream order."""
        params = dict(self.module.named_parameters())
        bucket: _Bucket | None = None
        for name in names:
            tensor = params[name]
            merge = self.merges.get(name)
            if merge is not None:
                tensor = self._merged(merge, tensor, params, dtype)
            plan = _gather_plan(tensor, self._mesh_groups)
            if plan is None:
                if bucket is not None:
                    yield bucket
                    bucket = None
                yield name, tensor.detach()
                continue
            group, world, coordinate = plan
            wire = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            param = _Sharded(name, tensor, wire, world, coordinate)
            device = param.local.device
            if bucket is not None and (bucket.group is not group or bucket.device != device):
                yield bucket
                bucket = None
            if param.rows_per_rank == 0:  # no rows at all: nothing to gather
                if bucket is not None:
                    yield bucket
                    bucket = None
                yield name, torch.empty(param.shape, dtype=param.dtype, device=device)
                continue
            rows_per_piece = max(1, self.bucket_bytes // world // max(param.row_bytes, 1))
            for first in range(0, param.rows_per_rank, rows_per_piece):
                end = min(first + rows_per_piece, param.rows_per_rank)
                size = _aligned((end - first) * param.row_bytes)
                if bucket is not None and (bucket.part_bytes + size) * world > self.bucket_bytes:
                    yield bucket
                    bucket = None
                if bucket is None:
                    bucket = _Bucket(group, device, world)
                bucket.pieces.append(_Piece(param, first, end, bucket.part_bytes, end == param.rows_per_rank))
                bucket.part_bytes += size
        if bucket is not None:
            yield bucket

    def _merged(self, merge: Merge, tensor: torch.Tensor, params: dict[str, Any], dtype: torch.dtype | None) -> torch.Tensor:
        """``tensor`` (a LoRA-targeted base weight) merged with its factors
        (``wt_callbacks.lora.merge``), in the wire dtype: the rows this rank
        holds under ``Shard(0)``, as a ``DTensor`` gathered like any other (so
        only the wire dtype's bytes move); a plain full tensor for other
        placements, or a merge that needs every row (DoRA on a transposed
        layout). The factors are gathered whole first: a collective, in the
        plan's order on every rank."""
        from torch.distributed.tensor import DTensor

        factors = {n: materialize_full_tensor(params[n].detach()) for n in merge.factors}
        out = dtype if dtype is not None else tensor.dtype
        plan = _gather_plan(tensor, self._mesh_groups)
        if plan is None or not merge.row_local:
            return merge.full(materialize_full_tensor(tensor.detach()), factors).to(out)
        _, world, coordinate = plan
        with torch.no_grad():
            local = tensor.to_local()
            start = coordinate * -(-tensor.shape[0] // world)
            merged = merge.rows(local, start, start + local.shape[0], factors).to(out)
        return DTensor.from_local(
            merged, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )

    def _buffer(self, role: str, parity: int, device: torch.device, nbytes: int) -> torch.Tensor:
        if device.type != "cpu":  # the caching allocator reuses freed blocks
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        key = (role, parity, device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self._scratch[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def _post(self, bucket: _Bucket, parity: int, keep: bool) -> _Posted:
        """Cast and copy this rank's rows into its part, then start the all-gather.

        A bucket that is one whole evenly sharded tensor is gathered straight
        into the full tensor's storage (all-gather's rank-major output is the
        tensor's row order), from the local shard itself when it needs no
        cast: no copies around the collective. Without ``keep`` every bucket
        is gathered into a scratch buffer.
        """
        piece = bucket.pieces[0]
        p = piece.param
        if len(bucket.pieces) == 1 and piece.first == 0 and piece.last and p.rows_per_rank * p.world == p.shape[0]:
            if keep:
                p.full = torch.empty(p.shape, dtype=p.dtype, device=bucket.device)
                out = p.full.view(-1).view(torch.uint8)
            else:
                out = self._buffer("out", parity, bucket.device, p.shape[0] * p.row_bytes)
            with torch.no_grad():
                if p.local.dtype == p.dtype and p.local.is_contiguous():
                    part = p.local.view(-1).view(torch.uint8)
                else:
                    part = self._buffer("part", parity, bucket.device, out.numel() // p.world)
                    part.view(p.dtype).view(p.local.shape).copy_(p.local)
            return _Posted(bucket, out, _all_gather(out, part, group=bucket.group, async_op=True), direct=True)
        part = self._buffer("part", parity, bucket.device, bucket.part_bytes)
        with torch.no_grad():
            for piece in bucket.pieces:
                p = piece.param
                end = min(piece.end, p.rows_of(p.coordinate))
                if end > piece.first:
                    dst = part[piece.offset : piece.offset + (end - piece.first) * p.row_bytes]
                    dst.view(p.dtype).view(end - piece.first, *p.shape[1:]).copy_(p.local[piece.first : end])
        out = self._buffer("out", parity, bucket.device, bucket.part_bytes * bucket.world)
        return _Posted(bucket, out, _all_gather(out, part, group=bucket.group, async_op=True))

    def _unpack(self, posted: _Posted, keep: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Wait for the all-gather, copy every rank's rows into the full tensors, yield the complete ones
        (without ``keep``: their names, with ``None``)."""
        posted.work.wait()
        bucket = posted.bucket
        if not keep:
            for piece in bucket.pieces:
                if piece.last:
                    yield piece.param.name, None
            return
        if posted.direct:
            p = bucket.pieces[0].param
            full, p.full = p.full, None
            yield p.name, full
            return
        by_rank = posted.out.view(bucket.world, bucket.part_bytes)
        for piece in bucket.pieces:
            p = piece.param
            if p.full is None:
                p.full = torch.empty(p.shape, dtype=p.dtype, device=bucket.device)
            flat = p.full.view(-1).view(torch.uint8)
            for r in range(bucket.world):
                end = min(piece.end, p.rows_of(r))
                if end > piece.first:
                    n = (end - piece.first) * p.row_bytes
                    start = (r * p.rows_per_rank + piece.first) * p.row_bytes
                    flat[start : start + n].copy_(by_rank[r, piece.offset : piece.offset + n])
            if piece.last:
                full, p.full = p.full, None
                yield p.name, full


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
