"""What a trainer engine sends: ``WeightSource`` and the metadata of each tensor.

Both released trainer-side contracts of vLLM are served by one class, so a
source written for either runs here (vLLM's ``base`` module path re-exports
these names: ``wt_callbacks.transfer.base``):

* vLLM 0.32: ``metadata()`` is a method and iteration is ``__iter__``.
* vLLM 0.33: ``metadata`` is a ``functools.cached_property`` (a list), the
  full tensors come from ``iter_full()``, this rank's pieces from
  ``iter_local()``, and each ``ParamMeta`` may name the trainer ranks that
  own it (``owners``) and how it is laid out over them (``placements``).

A subclass implements either form; the base derives the other, so
``iter(source)`` and ``source.iter_full()`` are the same pass. Engines read
the metadata through ``source_metadata``, which takes both forms; this
project's own sources return a ``Metadata`` list, which also answers a call,
so code of either release can read them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)


def materialize_full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Return the full (unsharded) tensor.

    An FSDP2 ``DTensor`` is all-gathered through ``full_tensor()``, which is a
    collective: every rank of the mesh must call it, in the same order. Other
    tensors pass through unchanged.
    """
    full_tensor = getattr(tensor, "full_tensor", None)
    if callable(full_tensor):
        return full_tensor()
    return tensor


@dataclass(frozen=True)
class Replicate:
    """A mesh axis along which every owner holds the whole extent (vLLM 0.33)."""


@dataclass(frozen=True)
class Shard:
    """A mesh axis that splits tensor dimension ``dim`` as ``torch.chunk`` does (vLLM 0.33)."""

    dim: int


Placement = Replicate | Shard


@dataclass(frozen=True)
class ParamMeta:
    """One sent tensor: its name, wire dtype and full (checkpoint) shape.

    The keyword-only fields are vLLM 0.33's ownership layout; every engine
    plans from metadata alone, so it must be the same on every trainer rank.

    Attributes:
        owners: the trainer ranks (``TrainerInitInfo.rank``) that own this
            tensor, in mesh order; ``None``: every rank. A rank iterates the
            tensors it owns (``WeightSource.owned_names``), and the gathers
            behind one tensor run among its owners.
        mesh_shape: row-major shape of the mesh over ``owners``; defaults to
            ``(len(owners),)``.
        placements: one ``Replicate`` or ``Shard`` per mesh axis: what
            ``iter_local()`` yields on each owner. ``None`` (also what an
            all-``Replicate`` layout becomes): each owner holds it whole.

    Raises:
        ValueError: a layout that cannot describe the tensor, naming it.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = field(default=None, kw_only=True)
    mesh_shape: tuple[int, ...] | None = field(default=None, kw_only=True)
    placements: tuple[Placement, ...] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        # Frozen: normalised through object.__setattr__, so that two metas
        # of one tensor compare (and hash) equal however they were given.
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.owners is None:
            if self.mesh_shape is not None or self.placements is not None:
                raise ValueError(f"{self.name!r}: mesh_shape and placements need owners")
            return
        owners = tuple(self.owners)
        if not owners or len(set(owners)) != len(owners) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in owners
        ):
            raise ValueError(f"{self.name!r}: owners must be distinct ranks >= 0, got {self.owners!r}")
        mesh_shape = (len(owners),) if self.mesh_shape is None else tuple(self.mesh_shape)
        if any(d <= 0 for d in mesh_shape) or math.prod(mesh_shape) != len(owners):
            raise ValueError(f"{self.name!r}: mesh_shape {mesh_shape} does not hold its {len(owners)} owners")
        placements = None if self.placements is None else tuple(self.placements)
        if placements is not None:
            if len(placements) != len(mesh_shape):
                raise ValueError(f"{self.name!r}: {len(placements)} placements for a {len(mesh_shape)}-axis mesh")
            for p in placements:
                if isinstance(p, Shard) and not 0 <= p.dim < len(self.shape):
                    raise ValueError(f"{self.name!r}: Shard({p.dim}) of a {len(self.shape)}-dimensional tensor")
                if not isinstance(p, (Shard, Replicate)):
                    raise TypeError(f"{self.name!r}: placement {p!r} is neither Replicate nor Shard")
            if all(isinstance(p, Replicate) for p in placements):
                placements = None
        object.__setattr__(self, "owners", owners)
        object.__setattr__(self, "mesh_shape", mesh_shape)
        object.__setattr__(self, "placements", placements)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def owned_by(self, rank: int) -> bool:
        return self.owners is None or rank in self.owners


class Metadata(list[ParamMeta]):
    """A source's metadata that reads as vLLM 0.33's ``metadata`` (a list)
    and answers vLLM 0.32's ``metadata()`` (a call returning itself), so code
    written for either release reads this project's sources unchanged."""

    def __call__(self) -> Metadata:
        return self


def source_metadata(source: Any) -> list[ParamMeta]:
    """The metadata of a source of either release: ``metadata()`` or ``metadata``."""
    metadata = source.metadata
    return list(metadata() if callable(metadata) else metadata)


class WeightSource(ABC):
    """A re-iterable source of the trainer's weights, handed to a trainer engine.

    Two channels:

    * metadata: ``(name, wire dtype, full shape)`` for every tensor, without
      transferring anything; vLLM 0.32's ``metadata()`` method or 0.33's
      ``metadata`` property (``functools.cached_property``), read by engines
      through ``source_metadata``. Receivers size their buffers and the
      packed chunk boundaries from it, so it must agree with iteration
      element for element (same names, order, dtypes, shapes); engines check
      this and name the first disagreement.
    * iteration: fully materialized ``(name, tensor)`` pairs, one at a time:
      ``__iter__`` (0.32) or ``iter_full()`` (0.33); implement either, the
      base gives the other. Materializing is typically a collective (FSDP
      ``full_tensor()``), so every owner of a tensor iterates the same
      source in the same order in lockstep, or ranks deadlock; a rank yields
      exactly its ``owned_names`` (all of them unless the metadata names
      owners). Each call is a fresh pass. A yielded tensor must stay valid
      and unchanged until the round ends: a transport may read it after the
      next ones were yielded (the shared-memory ring streams chunks straight
      from them), so a source must not refill one scratch buffer for
      several tensors.

    ``iter_local()`` (0.33) yields each owned tensor as this rank's piece
    (``ParamMeta.placements``); nothing derives it from the full tensors or
    back, and the engines here send full tensors.
    """

    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if type(self).iter_full is WeightSource.iter_full:
            raise NotImplementedError(
                f"{type(self).__name__} implements neither __iter__ (vLLM 0.32's WeightSource) "
                "nor iter_full() (vLLM 0.33's)"
            )
        return self.iter_full()

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full tensor of each name this rank owns, in metadata order."""
        if type(self).__iter__ is WeightSource.__iter__:
            raise NotImplementedError(f"{type(self).__name__} does not implement iter_full()")
        return iter(self)

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's piece of each name it owns, shaped by ``ParamMeta.placements``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_local()")

    def implements_iter_full(self) -> bool:
        return type(self).iter_full is not WeightSource.iter_full or type(self).__iter__ is not WeightSource.__iter__

    def implements_iter_local(self) -> bool:
        return type(self).iter_local is not WeightSource.iter_local

    def owned_names(self, rank: int) -> list[str]:
        """The names ``rank`` owns, in metadata order: exactly what it iterates."""
        return [m.name for m in source_metadata(self) if m.owned_by(rank)]

    def iter_uncast(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Iteration for a consumer that casts as it copies (the packed transports).

        The same pairs as iteration, except that a floating-point tensor may
        come in another floating-point dtype than its metadata dtype; the
        consumer converts it to the metadata (wire) dtype in the copy it
        makes anyway, instead of the source making a converted temporary.
        Sources that gather still cast before the gather (half the gathered
        bytes for a bf16 wire). The default is plain iteration.
        """
        return iter(self)

    def gather_only(self) -> Iterator[str]:
        """One pass as a trainer rank that does not send runs it.

        Such a rank iterates only so that the gathers (collectives) of the
        pass happen on every rank, in the same order; it drops the tensors.
        This runs those same collectives and yields each tensor's name once
        its gathers are done, but need not produce the full tensors: a
        source that gathers can skip building them (their allocation and
        the copies into them), which on a host whose cores the ranks share
        is time the sending rank waits for at its next collective. A
        partly consumed pass must still be iterated to the end (``drain``).
        The default iterates and drops the tensors.
        """
        return (name for name, _ in self.iter_uncast())

    def kept_metadata(self) -> list[ParamMeta]:
        """Tensors the servers keep as they hold them this pass: not in the
        metadata, not iterated, named to the servers so that a round without
        them is complete (``ModuleSource.keep``). The default: none."""
        return []

    def with_wire_dtype(self, dtype: torch.dtype | None) -> WeightSource:
        """This source, yielding (and describing) tensors in ``dtype``.

        The default casts after materializing. Sources that can cast before an
        FSDP gather (``ModuleSource``) override it: casting first halves the
        all-gather bytes and the gathered memory for a bf16 wire.
        """
        if dtype is None:
            return self
        return _CastSource(self, dtype)


def drain(items: Iterable[Any]) -> None:
    """Finish iterating a source after a failed round.

    The other trainer ranks are still in the same pass, each tensor an FSDP
    gather they expect this rank to join; stopping here would deadlock them.
    Errors are logged, never raised: the round already failed.
    """
    try:
        for _ in items:
            pass
    except Exception:  # noqa: BLE001 - already failing; never mask the first error
        logger.warning("draining the weight source after a failed round failed", exc_info=True)


class _CastSource(WeightSource):
    def __init__(self, inner: WeightSource, dtype: torch.dtype) -> None:
        self._inner = inner
        self._dtype = dtype

    @property
    def metadata(self) -> Metadata:  # type: ignore[override]
        return self._cast(source_metadata(self._inner))

    def kept_metadata(self) -> list[ParamMeta]:
        return self._cast(self._inner.kept_metadata())

    def _cast(self, metas: list[ParamMeta]) -> Metadata:
        return Metadata(dataclasses.replace(m, dtype=self._dtype) if m.dtype.is_floating_point else m for m in metas)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._inner:
            yield name, tensor.to(self._dtype) if tensor.is_floating_point() else tensor

    def iter_uncast(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._inner.iter_uncast()

    def gather_only(self) -> Iterator[str]:
        return self._inner.gather_only()


def check_sender_owns_all(metas: list[ParamMeta], backend: str) -> None:
    """Refuse a source whose metadata leaves a tensor to ranks other than 0.

    One rank sends every tensor here (the broadcast's root), and it iterates
    only the tensors it owns (vLLM 0.33's ``ParamMeta.owners``): a tensor it
    does not own would never reach the servers. Every rank reads the same
    metadata, so every rank raises alike, before any gather.
    """
    for m in metas:
        if not m.owned_by(0):
            raise ValueError(
                f"{m.name!r} is owned by trainer ranks {list(m.owners or ())}, but backend {backend!r} "
                "sends every tensor from rank 0: rank 0 must own every tensor (owners None, or including 0)"
            )


def check_full_tensors(source: WeightSource, backend: str) -> None:
    """Refuse a source that yields no full tensors (vLLM 0.33's ``iter_local``
    alone): the engines here send whole tensors and derive nothing from pieces."""
    if not isinstance(source, WeightSource):
        raise ValueError(f"source must be a WeightSource (e.g. ModuleSource(model)), got {type(source).__name__}")
    if not source.implements_iter_full():
        raise TypeError(
            f"backend {backend!r} sends full tensors, but {type(source).__name__} implements neither "
            "iter_full() nor __iter__"
        )
