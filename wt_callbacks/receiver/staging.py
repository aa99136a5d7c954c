"""``StagedWeights``: the reference receiver's spare copy of its parameters, a round staged into it.

A round's tensors are copied into the spare set as they arrive and swapped in
only when ``commit`` runs (at ``finish_weight_update``), so an interrupted or
refused round never touches the served parameters, and a ``commit: staged``
round streams while the receiver keeps generating from them.
"""

from collections.abc import Iterable, Sequence

import torch

from wt_callbacks.transfer.base import ParamMeta, dtype_name
from wt_callbacks.transfer.sources.checkpoint_format import CheckpointLayout
from wt_callbacks.transfer.sources.gathering import persistent_buffers


class StagedWeights:
    """Weight-update target that stages a round and applies it on commit.

    Given to the worker engine through ``set_weight_update_target``: the
    engine calls ``validate_update`` before receiving and ``load_weights``
    while receiving, exactly as it would call a vLLM model. Names are the
    checkpoint's, as a vLLM server takes them: a transformers model's
    in-memory conversions (packed MoE experts) are applied at commit, as
    ``from_pretrained`` applies them.

    Each tensor is copied (and converted to the model's dtype) into a spare
    tensor as it arrives, while the transport receives the next chunk; commit
    then swaps the spares in (``param.data``) instead of copying the whole
    model after the stream (up to 40% of a round at 496M over shm). ``spares``: the
    spare tensors, kept by the caller between rounds (a swap leaves the old
    values there, to be overwritten by the next round), so their memory, one
    copy of the parameters, is faulted in once. Since every tensor is copied
    before the next one is asked for, ``copies_loaded_tensors`` tells the
    engine it may reuse its receive buffers within the round; over the shm
    ring a tensor is received straight into its spare (``receive_into``),
    converted from the wire's dtype as it is copied out of the ring.
    """

    copies_loaded_tensors = True
    keeps_tensors = True
    """A round may keep tensors (``validate_update``'s ``kept``): their
    parameters are left as they are at commit."""

    def __init__(
        self,
        model: torch.nn.Module,
        layout: CheckpointLayout | None = None,
        spares: dict[str, torch.Tensor] | None = None,
    ) -> None:
        # What a sync sends: the parameters and the persistent buffers.
        self._params = {**dict(model.named_parameters()), **persistent_buffers(model)}
        self._layout = layout if layout is not None else CheckpointLayout(model)
        groups = self._layout.plan([ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self._params.items()])
        self._group_of = {o.name: g for g in groups for o in g.outputs}
        self._expected = {o.name: o for g in groups for o in g.outputs}
        self._spares = spares if spares is not None else {}
        self._staged: dict[str, torch.Tensor] = {}
        # The wire dtype of the tensors received straight into their spares:
        # ``bytes`` counts what arrived, not the spare's size.
        self._received_as: dict[str, torch.dtype] = {}
        self._announced: set[str] = set()  # the round's names so far, over its updates
        self.tensors = 0
        self.bytes = 0

    def validate_update(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype],
        shapes: Sequence[tuple[int, ...]],
        *,
        kept: tuple[Sequence[str], Sequence[torch.dtype], Sequence[tuple[int, ...]]] | None = None,
    ) -> None:
        """Refuse an update before anything is received: a name, shape or kind
        of dtype the served model does not have, or one an earlier update of
        the round sent or kept. A round may send the model in several updates
        (one per tensor, as TRL's classic client does): whether it left a
        tensor out is checked at finish (``check_complete``), before anything
        is applied. ``kept``: tensors the round leaves as they are, which
        count towards a complete round; a tensor that a converted group
        (packed MoE experts) rebuilds together with others is kept only with
        all of them."""
        kept_names = list(kept[0]) if kept is not None else []
        self.check_tensors(names, dtypes, shapes)
        if kept is not None:
            self.check_tensors(*kept)
        again = next((n for n in [*names, *kept_names] if n in self._announced), None)
        if again is not None:
            raise ValueError(f"{again!r} was already sent in this round")
        kept_set = set(kept_names)
        for name in kept_names:
            group = self._group_of[name]
            split = [o.name for o in group.outputs if o.name not in kept_set]
            if group.converted and split:
                raise ValueError(
                    f"the round keeps {name!r} but not {split[0]!r}, which the served model rebuilds with it "
                    "into one parameter: keep both or send both"
                )
        self._announced.update(names)
        self._announced.update(kept_names)

    def check_round_complete(self) -> None:
        # A round without any update changes no weight (it sets the version, as in vLLM).
        if self._announced:
            self.check_complete(self._announced)

    def check_complete(self, names: Iterable[str]) -> None:
        """Raise naming the first checkpoint tensor of the served model that
        ``names`` leave out. A tied parameter counts once, under the name
        ``named_parameters`` gives it (a tied ``lm_head`` sent as its embedding)."""
        sent = set(names)
        missing = [n for n in self._expected if n not in sent]
        if missing:
            more = f" (and {len(missing) - 1} more checkpoint tensors)" if len(missing) > 1 else ""
            raise ValueError(
                f"this round does not send checkpoint tensor {missing[0]!r}{more}, which the served model holds: "
                f"it sends {len(self._expected) - len(missing)} of its {len(self._expected)}. Nothing was "
                "applied; the server keeps the previous weights. The trainer must send every parameter of "
                "the served model (check its module / include / exclude)"
            )

    def check_tensors(
        self, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[tuple[int, ...]]
    ) -> None:
        """Raise for a name the served model does not have, or a shape or
        kind of dtype not its own."""
        unknown = [n for n in names if n not in self._expected]
        if unknown:
            raise ValueError(
                f"{len(unknown)} parameter name(s) not in the served model, e.g. {unknown[:3]}; "
                f"the model has e.g. {list(self._expected)[:3]}. Check the trainer's module / name "
                "prefixes (select the submodule that holds the checkpoint)"
            )
        for name, dtype, shape in zip(names, dtypes, shapes):
            expected = self._expected[name]
            if tuple(expected.shape) != tuple(shape):
                raise ValueError(
                    f"shape mismatch for {name!r}: trainer sends {list(shape)}, the served model has "
                    f"{list(expected.shape)}"
                )
            if dtype.is_floating_point != expected.dtype.is_floating_point:
                raise ValueError(
                    f"dtype mismatch for {name!r}: trainer sends {dtype_name(dtype)}, the served "
                    f"model has {dtype_name(expected.dtype)}"
                )

    def receive_into(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Where the engine may receive ``name`` straight into: its spare, when
        the wire carries it in the spare's shape and dtype, or another
        floating-point dtype to convert from (otherwise it comes in a receive
        buffer and ``load_weights`` copies it)."""
        if name not in self._expected:
            return None
        spare = self._spare(name)
        convertible = spare.dtype == dtype or (spare.dtype.is_floating_point and dtype.is_floating_point)
        fits = convertible and tuple(spare.shape) == tuple(shape) and spare.is_contiguous()
        if not fits:
            return None
        self._received_as[name] = dtype
        return spare

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                if name not in self._expected:
                    raise ValueError(f"parameter {name!r} is not in the served model")
                spare = self._spare(name)
                wire = tensor.dtype
                if tensor is spare:  # received straight into it
                    wire = self._received_as[name]
                else:
                    spare.copy_(tensor)
                self._staged[name] = spare
                self.tensors += 1
                self.bytes += tensor.numel() * wire.itemsize

    def _spare(self, name: str) -> torch.Tensor:
        """The spare for checkpoint tensor ``name``: shaped like the parameter
        it replaces, or for a converted group like the checkpoint tensor."""
        spare = self._spares.get(name)
        if spare is None:
            group = self._group_of[name]
            if group.converted:
                meta = self._expected[name]
                device = self._params[group.inputs[0]].device
                spare = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            else:
                spare = torch.empty_like(self._params[group.inputs[0]])
            self._spares[name] = spare
        return spare

    def commit(self) -> None:
        done: set[int] = set()
        with torch.no_grad():
            for name in list(self._staged):
                group = self._group_of[name]
                if id(group) in done:
                    continue
                done.add(id(group))
                if not group.converted:
                    param = self._params[group.inputs[0]]
                    self._spares[name], param.data = param.data, self._staged[name]
                    continue
                # A converted group is rebuilt whole, from all its tensors
                # (``check_complete`` saw every one staged).
                outputs = {o.name: self._staged[o.name] for o in group.outputs}
                for param_name, tensor in self._layout.to_memory(group, outputs).items():
                    self._params[param_name].copy_(tensor)
        self._staged.clear()
