"""``ModuleSource``: the weights of a training module as a server loads them.

The one source the framework adapters build, from the module as the training
framework holds it. Four concerns, each in its own room:

* gathering, per sharding scheme, detected from the module
  (``sources.schemes``; the gatherers' base class in ``sources.gathering``):
  full tensors, cast to the wire dtype before the gather, every rank in the
  same order;
* names (``wt_callbacks.naming``): the selected submodule, wrapper segments
  such as ``module.`` or ``_orig_mod.`` stripped;
* the checkpoint format (``sources.checkpoint_format``): transformers'
  in-memory conversions undone per tensor group;
* selection: ``include`` / ``exclude`` on the names sent;
* a PEFT (LoRA) model (``wt_callbacks.lora``): its base checkpoint's names,
  each LoRA-targeted tensor merged with its factors by the gatherer, where
  the scheme holds it (``lora: merge``);
* keeping: the frozen tensors a round may leave as the servers hold them
  (``sources.frozen``), left out of a pass when the driver says so (``keep``).

The plan linking them (which parameters feed which sent tensors) is built
from names and shapes alone, so ``metadata()`` never gathers, and it is
rebuilt only when the parameters change (``fully_shard`` after setup, which
also changes the gatherer).
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch

from wt_callbacks.lora.layout import LoraLayout
from wt_callbacks.naming import checkpoint_name, find_submodule
from wt_callbacks.transfer.weight_source import Metadata, ParamMeta, WeightSource
from wt_callbacks.transfer.sources.checkpoint_format import CheckpointLayout, ConversionGroup
from wt_callbacks.transfer.sources.frozen import keepable
from wt_callbacks.transfer.sources.gathering import ParameterGather, in_wire_dtype, persistent_buffers
from wt_callbacks.transfer.sources.schemes import gather_for, sharding_scheme

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Plan:
    """What one round gathers and sends, derived from the parameters' metadata."""

    gather_names: tuple[str, ...]
    """Parameter names as the module holds them, to gather, in stream order."""
    buffer_names: tuple[str, ...]
    """Persistent buffers to send after them (whole on every rank)."""
    groups: tuple[ConversionGroup, ...]
    """The groups with at least one sent output, in completion order."""
    selected_groups: tuple[ConversionGroup, ...]
    """The groups with at least one selected output, kept ones included."""
    names: dict[str, str]
    """Checkpoint-format inputs of ``groups`` by the names held (wrapper
    segments stripped; a PEFT model's base names)."""
    sent: frozenset[str]
    kept: frozenset[str]
    """Selected, and left as the servers hold them (``ModuleSource.keep``)."""
    unselected: frozenset[str]

    @property
    def metadata(self) -> list[ParamMeta]:
        return [o for g in self.groups for o in g.outputs if o.name in self.sent]

    @property
    def kept_metadata(self) -> list[ParamMeta]:
        return [o for g in self.selected_groups for o in g.outputs if o.name in self.kept]


@dataclass
class _Keeping:
    """The names a pass leaves out, shared by a source and its wire-dtype copies."""

    names: frozenset[str] = frozenset()


class ModuleSource(WeightSource):
    """``WeightSource`` over a (possibly wrapped or sharded) module, in checkpoint format.

    Iterating yields what ``save_pretrained`` would write for the selected
    module: checkpoint names, full shapes and layouts, tied parameters once,
    persistent buffers after the parameters. A module that is not a
    transformers model is sent as its ``named_parameters()`` and persistent
    buffers (its ``state_dict()``, wrapper segments stripped).

    Args:
        module: the module as the training framework holds it: plain, DDP,
            ``torch.compile``, activation checkpointing, FSDP2 (``fully_shard``),
            the FSDP1 root (``FullyShardedDataParallel``, either
            ``use_orig_params``), a DeepSpeed engine (ZeRO stage 0-3). The
            sharding scheme is detected, never configured.
        dtype: wire dtype for floating-point parameters (``None``: each
            parameter's own). The cast happens before the gather (FSDP1,
            FSDP2), halving the gathered bytes for a bf16 wire; DeepSpeed
            ZeRO-3 gathers in the parameter dtype.
        submodule: path of the part to send, in checkpoint naming (``"model"``
            for ``pl_module.model``); ``None`` sends the whole module.
        include: ``fnmatch`` patterns; a sent name is kept if it matches one
            (empty: all).
        exclude: ``fnmatch`` patterns; a sent name matching one is dropped.
        lora: for a PEFT model, ``"merge"`` (the default) sends the base
            checkpoint with the active adapters merged in; ``None`` detects
            the PEFT model. (``lora: adapter`` is ``wt_callbacks.lora.adapter.AdapterSource``.)

    Raises:
        ValueError: at construction, naming what to fix: an unknown
            submodule, two parameters with one checkpoint name, patterns that
            leave nothing to send, a sharding scheme that cannot be gathered,
            a conversion transformers cannot reverse, a PEFT model that
            cannot be merged (``LoraLayout.check_merge``).

    Every trainer rank must build and iterate the same source: gathers are
    collectives.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        dtype: torch.dtype | None = None,
        submodule: str | None = None,
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
        lora: str | None = None,
    ) -> None:
        if lora not in (None, "merge"):
            raise ValueError(f"lora={lora!r}: ModuleSource sends lora: merge; lora: adapter is AdapterSource")
        self._module = module
        self._dtype = dtype
        self._submodule = submodule
        self.include = tuple(include)
        self.exclude = tuple(exclude)
        self._root = find_submodule(module, submodule)
        self._gather: ParameterGather = gather_for(module, submodule)
        self._held_by = sharding_scheme(module, self._root)
        self.lora = LoraLayout.of(self._root)
        if self.lora is None and lora is not None:
            raise ValueError(
                f"lora: {lora}: module={submodule!r} ({type(self._root).__name__}) holds no PEFT model; remove lora "
                "(or give module: the path of the PEFT model)"
            )
        if self.lora is not None:
            self.lora.check_merge()
        self._layout = CheckpointLayout(self._root, rename=None if self.lora is None else self.lora.module_base)
        self._keeping = _Keeping()
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        """The plans of the last two keys: a round with kept tensors and one
        without alternate (``keep``), each built once."""
        plan = self._plan()
        for key, patterns in (("include", self.include), ("exclude", self.exclude)):
            for pattern in patterns:
                if not any(fnmatchcase(n, pattern) for n in plan.sent | plan.unselected):
                    logger.warning("%s pattern %r matches none of the sent names", key, pattern)

    @property
    def module(self) -> torch.nn.Module:
        """The module given (as the framework holds it)."""
        return self._module

    @property
    def scheme(self) -> str:
        """How the module's parameters are held, as detected: ``"local"``
        (whole tensors or FSDP2 ``DTensor`` s), ``"fsdp1"``, ``"zero3"``."""
        return self._gather.scheme

    def with_wire_dtype(self, dtype: torch.dtype | None) -> WeightSource:
        if dtype is None or dtype == self._dtype:
            return self
        cast = copy.copy(self)
        cast._dtype = dtype
        cast._plans = {}
        return cast

    @property
    def metadata(self) -> Metadata:  # type: ignore[override]
        """Every sent tensor, owned by every rank (each joins every gather):
        a list (vLLM 0.33's ``source.metadata``) that answers a call too
        (0.32's ``source.metadata()``). Rebuilt only when the parameters change."""
        return Metadata(self._plan().metadata)

    def kept_metadata(self) -> list[ParamMeta]:
        """The tensors ``keep`` leaves out of the passes, in wire dtype."""
        return self._plan().kept_metadata

    def frozen_names(self) -> frozenset[str]:
        """The sent tensors a round may leave as the servers hold them, read
        now: made only of parameters that do not train, none a LoRA layer's
        base, in whole serving units (``sources.frozen``). The same on
        every rank whose parameters train alike."""
        plan = self._plan()
        frozen_held = self._gather.frozen()
        return keepable(
            self._root,
            held={name: raw in frozen_held for raw, name in plan.names.items()},
            targeted={self.lora.base_name(n) for n in self.lora.targeted} if self.lora is not None else (),
            groups=plan.selected_groups,
            module_base=self.lora.module_base if self.lora is not None else (lambda path: path),
        )

    def keep(self, names: Iterable[str]) -> None:
        """Leave ``names`` (sent names) out of the following passes, describing
        them in ``kept_metadata()`` instead, until called again (``()``: send
        everything). Shared with this source's wire-dtype copies, so the
        engine's copy follows. Every rank keeps the same names: what is left
        out is not gathered."""
        self._keeping.names = frozenset(names)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if type(self).iter_full is not ModuleSource.iter_full:
            return self.iter_full()
        return self._sent(self._dtype)

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        if type(self).__iter__ is not ModuleSource.__iter__:
            return iter(self)
        return self._sent(self._dtype)

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every rank owns every tensor whole (the metadata names no owners
        or placements), so this rank's piece of each is the full tensor."""
        return self.iter_full()

    def _iteration_overridden(self) -> bool:
        """A subclass that overrides ``__iter__`` (vLLM 0.32's way) or
        ``iter_full`` (0.33's) is iterated as it says: its own iteration is
        what it means to send."""
        return type(self).__iter__ is not ModuleSource.__iter__ or type(self).iter_full is not ModuleSource.iter_full

    def iter_uncast(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Cast before a gather that communicates; whole parameters go as they
        are, for the transport to cast as it copies them (the checkpoint-format
        conversions only move values, so converting before or after the cast
        sends the same bytes). A subclass's own iteration is used as it is
        (``_iteration_overridden``)."""
        if self._iteration_overridden():
            return iter(self)
        return self._sent(self._gather_dtype())

    def gather_only(self) -> Iterator[str]:
        """The gathers of ``iter_uncast()``'s pass, each gatherer skipping what
        only a sender needs (the full tensors, the checkpoint-format
        conversions, the buffers); a subclass with its own iteration is
        iterated."""
        if self._iteration_overridden():
            return super().gather_only()
        return self._gather.gather_only(self._plan().gather_names, self._gather_dtype())

    def _gather_dtype(self) -> torch.dtype | None:
        return self._dtype if self._gather.communicates else None

    def _sent(self, gather_dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        plan = self._plan()
        gathered = ((plan.names[raw], t) for raw, t in self._gather.gather(plan.gather_names, gather_dtype))
        buffers = persistent_buffers(self._root)
        whole = ((plan.names[raw], in_wire_dtype(buffers[raw].detach(), gather_dtype)) for raw in plan.buffer_names)
        yield from self._convert(plan, itertools.chain(gathered, whole))

    # -- the plan --------------------------------------------------------------

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        return self._dtype if self._dtype is not None and dtype.is_floating_point else dtype

    def _selected(self, name: str) -> bool:
        if self.include and not any(fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatchcase(name, p) for p in self.exclude)

    def _plan(self) -> _Plan:
        held_by = sharding_scheme(self._module, self._root)
        if held_by != self._held_by:  # sharded after this source was built (fully_shard, FSDP1)
            self._gather, self._held_by = gather_for(self._module, self._submodule), held_by
        buffers = persistent_buffers(self._root)
        held = self._gather.parameters() + [ParamMeta(n, b.dtype, tuple(b.shape)) for n, b in buffers.items()]
        metas_held = tuple(ParamMeta(m.name, self._wire(m.dtype), m.shape) for m in held)
        keeping = self._keeping.names
        # The scheme is part of the key: a new gatherer (FSDP2 keeps names and
        # global shapes) needs its merges set by a plan of its own.
        key = (held_by, metas_held, None if self.lora is None else self.lora.state(), keeping)
        if key in self._plans:
            return self._plans[key]
        if self.lora is not None and self._plans and all(k[:3] != key[:3] for k in self._plans):
            # Another adapter active, or one merged in place: other merges.
            self.lora = LoraLayout.of(self._root)
            assert self.lora is not None
            self.lora.check_merge()
        origin: dict[str, str] = {}
        metas = []
        for m in metas_held:
            name = checkpoint_name(m.name)
            if self.lora is not None:
                name = self.lora.base_name(name)
                if name is None:  # an adapter's own tensor: merged into its base tensor
                    continue
            if name in origin:
                raise ValueError(
                    f"parameters {origin[name]!r} and {m.name!r} both become {name!r} once wrapper "
                    "prefixes are stripped; send only one of them with module= or exclude="
                )
            origin[name] = m.name
            metas.append(ParamMeta(name, m.dtype, m.shape))
        groups = self._layout.plan(metas)
        outputs = {o.name for g in groups for o in g.outputs}
        selected = frozenset(n for n in outputs if self._selected(n))
        if not selected:
            names = [m.name for m in metas]
            raise ValueError(
                f"nothing to send: module={self._submodule!r} include={list(self.include)} "
                f"exclude={list(self.exclude)} select none of the {len(names)} parameters "
                f"(names look like {names[:4]}); fix include / exclude / module"
            )
        sent = selected - keeping
        used = tuple(g for g in groups if any(o.name in sent for o in g.outputs))
        needed = {i for g in used for i in g.inputs}
        selected_groups = tuple(g for g in groups if any(o.name in selected for o in g.outputs))
        if self.lora is not None:
            # The gatherer merges, in the names it holds, where the scheme keeps
            # the rows. Every selected weight's merge, kept or not (a gatherer
            # looks up only the names it gathers), so that the plans cached for
            # other keep sets find the gatherer's merges right too.
            raw = {checkpoint_name(m.name): m.name for m in held}
            inputs = {i for g in selected_groups for i in g.inputs}
            self._gather.merges = {
                raw[n]: merge.renamed(raw) for n, merge in self.lora.merges.items() if self.lora.base_name(n) in inputs
            }
        plan = _Plan(
            gather_names=tuple(origin[m.name] for m in metas if m.name in needed and origin[m.name] not in buffers),
            buffer_names=tuple(origin[m.name] for m in metas if m.name in needed and origin[m.name] in buffers),
            groups=used,
            selected_groups=selected_groups,
            names={raw: name for name, raw in origin.items()},
            sent=sent,
            kept=selected & keeping,
            unselected=frozenset(outputs - selected),
        )
        self._plans = {k: p for k, p in self._plans.items() if k[:3] == key[:3]} | {key: plan}
        if len(self._plans) > 2:
            del self._plans[next(iter(self._plans))]
        return plan

    def _convert(self, plan: _Plan, gathered: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Gathered in-memory tensors to the sent checkpoint tensors, a group
        at a time: a group's tensors are held only until its last one arrives."""
        completes = {g.inputs[-1]: g for g in plan.groups}
        waiting: dict[str, torch.Tensor] = {}
        for name, tensor in gathered:
            waiting[name] = tensor
            del tensor
            group = completes.get(name)
            if group is None:
                continue
            outputs = self._layout.to_checkpoint(group, {i: waiting.pop(i) for i in group.inputs})
            for out in group.outputs:
                tensor = outputs.pop(out.name)
                if out.name in plan.sent:
                    yield out.name, tensor
                del tensor
