"""PEFT's merge rule, applied to gathered tensors in float32, a whole tensor or a range of its rows.

``W' = W + sum_a s_a * delta_a`` over the layer's active adapters, in the
order PEFT merges them, with ``delta = B @ A`` in the layout of ``W``:
transposed for fan-in-fan-out layers (GPT-2's ``Conv1D``, whose weight is
``(in, out)``) and embeddings (``(vocab, hidden)`` from ``A (r, vocab)``,
``B (hidden, r)``), per expert for a packed MoE parameter (PEFT's
``ParamWrapper``: ``A (E*r, in)``, ``B (out, r*E)``). DoRA scales each output
row by ``m / ||W + delta||`` (the norm over the input dimension, taken on the
unmerged weight, as PEFT's merge does). ``lora_bias`` adds ``s * b_B`` to the
base bias.

Everything is computed in float32 (the factors, the base rows, the sum) and
cast to the wire dtype only afterwards by the caller: merging in bf16 rounds
small updates away (PEFT's own merge of bf16 factors on a CPU computes the
product in float32 too, then casts it before adding).

Why rows: the sharded sources merge where the rows are. FSDP2 holds rows of
``W`` (``Shard(0)``); ``rows(start, stop)`` merges exactly those, with the
factors gathered whole (they are tiny), so the merged shard is cast and
gathered like any other and only the wire dtype's bytes move. The rows of a
product are computed from the same dot products as the whole product, which
made a per-shard merge under FSDP2 bitwise equal to the unsharded one.

The scaling and the active adapters are read from the live PEFT layers when
a merge runs: ``set_scale`` / ``scale_layer`` between rounds take effect.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

LINEAR = "linear"
"""``delta = B @ A``, shaped like ``W`` (out, in)."""
TRANSPOSED = "transposed"
"""``delta = (B @ A).T``: fan-in-fan-out layers and embeddings (rows of ``W`` are columns of ``A``)."""
EXPERTS = "experts"
"""A packed MoE parameter (E, X, Y): one ``B_e @ A_e`` per expert (rows of ``W`` are experts)."""
BIAS = "bias"
"""The base bias of a ``lora_bias`` layer: ``b + s * b_B``."""


@dataclass(frozen=True)
class Term:
    """One active adapter's contribution to a merged tensor.

    Attributes:
        layer: the live PEFT layer (its ``scaling`` is read at each merge).
        adapter: the adapter's name in the layer.
        a: name of ``A`` (or of ``lora_embedding_A``) as the source holds it;
            ``None`` for ``BIAS``.
        b: name of ``B`` (``lora_B``'s bias for ``BIAS``).
    """

    layer: Any
    adapter: str
    a: str | None
    b: str

    @property
    def scaling(self) -> float:
        return float(self.layer.scaling[self.adapter])


@dataclass(frozen=True)
class Merge:
    """How one base tensor (``base``, a name as the source holds it) is sent merged.

    Attributes:
        base: the base tensor's name.
        kind: ``LINEAR``, ``TRANSPOSED``, ``EXPERTS`` or ``BIAS``.
        terms: the active adapters' factors, in PEFT's merge order.
        magnitude: DoRA's magnitude vector (``lora_magnitude_vector``), if any.
        experts: number of experts (``EXPERTS``).
        swapped: ``EXPERTS`` parameter laid out (E, out, in) rather than (E, in, out).
    """

    base: str
    kind: str
    terms: tuple[Term, ...]
    magnitude: str | None = None
    experts: int = 1
    swapped: bool = False

    def renamed(self, names: Mapping[str, str]) -> Merge:
        """This merge with every tensor name mapped through ``names`` (checkpoint names to the names a gatherer holds)."""
        terms = tuple(replace(t, a=None if t.a is None else names[t.a], b=names[t.b]) for t in self.terms)
        magnitude = None if self.magnitude is None else names[self.magnitude]
        return replace(self, base=names[self.base], terms=terms, magnitude=magnitude)

    @property
    def factors(self) -> tuple[str, ...]:
        """The names the merge needs besides ``base``, in a fixed order."""
        names = [n for t in self.terms for n in (t.a, t.b) if n is not None]
        if self.magnitude is not None:
            names.append(self.magnitude)
        return tuple(names)

    @property
    def row_local(self) -> bool:
        """Whether a range of rows merges from those rows of ``base`` alone.
        DoRA on a transposed layout normalises columns of ``base``, which span every row."""
        return not (self.magnitude is not None and self.kind == TRANSPOSED)

    def full(self, base: torch.Tensor, factors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The merged tensor (float32) from the whole ``base`` and the whole factors."""
        return self.rows(base, 0, base.shape[0], factors)

    def rows(self, base_rows: torch.Tensor, start: int, stop: int, factors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Rows ``[start, stop)`` of the merged tensor (float32), from those rows
        of ``base`` (``base_rows``) and the whole factors. Only for ``row_local``
        merges, or the whole tensor."""
        w = base_rows.detach().float()
        if self.kind == BIAS:
            for t in self.terms:
                w = w + factors[t.b].detach().float()[start:stop] * t.scaling
            return w
        # One new tensor per merged weight, its first delta, which every
        # later step updates in place: a round allocates (and page-faults)
        # the merged weights once, not three times. ``delta + w`` is
        # ``w + delta`` bit for bit, and later deltas add in PEFT's order.
        merged: torch.Tensor | None = None
        for term in self.terms:
            delta = self._delta(term, start, stop, factors)
            merged = delta.add_(w) if merged is None else merged.add_(delta)
        assert merged is not None
        if self.magnitude is None:
            return merged
        magnitude = factors[self.magnitude].detach().float()
        if self.kind == TRANSPOSED:  # (in, out): a column per output; needs every row
            return merged.mul_((magnitude / torch.linalg.norm(merged, dim=0)).view(1, -1))
        return merged.mul_((magnitude[start:stop] / torch.linalg.norm(merged, dim=1)).view(-1, 1))

    def _delta(self, term: Term, start: int, stop: int, factors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """A new (contiguous) float32 tensor: ``s * B @ A`` for rows ``[start, stop)``, in the base's layout."""
        a = factors[term.a].detach().float()
        b = factors[term.b].detach().float()
        s = term.scaling
        if self.kind == LINEAR:
            return (b[start:stop] @ a).mul_(s)
        if self.kind == TRANSPOSED:
            return (b @ a[:, start:stop]).T.contiguous().mul_(s)
        # PEFT's ParamWrapper: A (E*r, in) -> (E, r, in); B (out, r*E) -> (out, r, E).
        a = a.reshape(self.experts, -1, a.shape[-1])[start:stop]
        b = b.reshape(b.shape[0], -1, self.experts)[:, :, start:stop]
        return torch.einsum("o r e, e r i -> e o i" if self.swapped else "o r e, e r i -> e i o", b, a).contiguous().mul_(s)
