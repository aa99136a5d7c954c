"""FSDP1 (``FullyShardedDataParallel``): full parameters one unit at a time.

FSDP1 flattens each unit's parameters into one ``FlatParameter`` and keeps
a shard of it per rank. The public way to unshard
(``summon_full_params``) gathers in full precision only, even under
``MixedPrecision``. So the gather is done here, from the layout FSDP1
records on the flat parameter: each rank casts its local shard to the wire
dtype, one all-gather per unit over the unit's process group fills a buffer
this gatherer owns, and the original parameters are cut out of it as views.
That is FSDP1's own unshard with the cast moved in front: half the gathered
bytes for a bf16 wire. It works for both ``use_orig_params`` settings,
every sharding strategy and CPU offload (the shard moves to the compute
device first, as FSDP1 does for forward).

Private FSDP1 attributes used (stable since torch 2.1; FSDP1 is in
maintenance): ``FullyShardedDataParallel._handle`` and ``training_state``;
the handle's ``flat_param``, ``uses_sharded_strategy``, ``process_group``,
``device`` and ``_training_state``; the flat parameter's ``_local_shard`` (once set),
``_fqns``, ``_shapes``, ``_strides``, ``_contiguities``,
``_numels_with_padding``, ``_is_padding_mask``, ``_unpadded_unsharded_size``,
``_params``, ``_shared_params`` and ``_param_extensions``. The tests pin them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from wt_callbacks.lora.merge import Merge
from wt_callbacks.naming import checkpoint_name
from wt_callbacks.transfer.weight_source import ParamMeta
from wt_callbacks.transfer.sources.gathering import ParameterGather, in_wire_dtype


@dataclass(frozen=True)
class _Unit:
    """One FSDP unit and the selected parameters of its flat parameter."""

    fsdp: torch.nn.Module
    names: tuple[str, ...]
    """Sent names (checkpoint naming, relative to the selected submodule)."""
    indices: tuple[int, ...]
    """Their positions among the flat parameter's original parameters."""


class FSDP1Units(ParameterGather):
    """FSDP1 parameters, gathered a unit at a time after the cast.

    Units come in ``named_modules()`` order (the root unit first), then the
    parameters no unit manages (ignored modules), as plain tensors. A
    yielded tensor is a view into the buffer its unit was gathered into,
    which is never refilled: it stays valid for as long as the transport
    holds it. Peak extra memory: the largest unit in the wire dtype (the
    units whose views the transport still holds, and gloo's own copy of the
    unit while it gathers on a CPU, come on top).

    LoRA: a weight in ``merges`` is sent merged with its factors
    (``wt_callbacks.lora.merge``): its unit is gathered in its own dtype and
    the weight merged in float32 before the cast; factors in other units
    (PEFT's ``fsdp_auto_wrap_policy`` wraps each one) are gathered first and
    held only until the last weight needing them is merged (a few of the
    adapter's small tensors on top of the bound above).

    Names: a parameter is named by its first path in ``named_parameters()``
    of the module given, as ``ModuleSource`` names an unwrapped model's, so
    a weight tied across units (``use_orig_params=True`` registers the one
    flat copy at both paths) is sent once, under the name of its first use.
    With ``use_orig_params=False`` FSDP1 unties weights that it flattens
    into different units (each unit trains its own copy from then on), and
    both are sent; keep tied modules in one unit.

    Args:
        module: the module holding the FSDP root (Lightning:
            ``trainer.strategy.model``; Accelerate: the model
            ``accelerator.prepare`` returned).
        submodule: the part to report, a path in checkpoint naming.

    Raises:
        ValueError: FSDP1 with tensor parallelism (2-D parameters inside
            flat parameters), or flat shards whose unit lies outside ``module``.
    """

    scheme = "fsdp1"

    def __init__(self, module: torch.nn.Module, submodule: str | None = None) -> None:
        super().__init__(module)
        self._prefix = f"{submodule}." if submodule else ""
        self._units, self._plain, self._metas = self._plan()

    def _selected(self, raw: str) -> str | None:
        """The name of parameter ``raw`` (its path in ``module``) relative to
        the submodule, or ``None`` outside it."""
        name = checkpoint_name(raw)
        return name[len(self._prefix) :] if name.startswith(self._prefix) else None

    def _plan(self) -> tuple[list[_Unit], dict[str, torch.nn.Parameter], list[ParamMeta]]:
        from torch.distributed.fsdp import FullyShardedDataParallel

        first_path = {id(p): raw for raw, p in self.module.named_parameters()}
        managed: set[int] = set()
        units: list[_Unit] = []
        metas: list[ParamMeta] = []
        for path, unit in self.module.named_modules():
            if not isinstance(unit, FullyShardedDataParallel) or unit._handle is None:
                continue
            flat = unit._handle.flat_param
            if any(extension is not None for extension in flat._param_extensions):
                raise ValueError(
                    f"FSDP1 unit {path or 'at the root'!r} holds tensor-parallel (DTensor) parameters: FSDP1 "
                    "with tensor parallelism is not supported; use FSDP2 (fully_shard) on a 2-D device mesh"
                )
            managed.add(id(flat))
            managed.update(id(p) for p in (*(flat._params or ()), *(flat._shared_params or ())))
            originals = flat._params or [None] * len(flat._fqns)
            # Other paths of a tensor shared within the unit: the one inside
            # the submodule names it when its first path lies outside.
            also_at: dict[str, list[str]] = {}
            for info in flat._shared_param_infos:
                primary = f"{info.prim_module_name}.{info.prim_param_name}" if info.prim_module_name else info.prim_param_name
                also_at.setdefault(primary, []).append(f"{info.module_name}.{info.param_name}" if info.module_name else info.param_name)
            names, indices = [], []
            for index, (fqn, shape, original) in enumerate(zip(flat._fqns, flat._shapes, originals)):
                raw = first_path.get(id(original)) if original is not None else None
                in_unit = [f"{path}.{f}" if path else f for f in (fqn, *also_at.get(fqn, ()))]
                name = next((n for n in map(self._selected, [raw, *in_unit] if raw else in_unit) if n is not None), None)
                if name is not None:
                    names.append(name)
                    indices.append(index)
                    metas.append(ParamMeta(name, flat.dtype, tuple(shape)))
            if names:
                units.append(_Unit(unit, tuple(names), tuple(indices)))
        plain: dict[str, torch.nn.Parameter] = {}
        for raw, param in self.module.named_parameters():
            if id(param) in managed:
                continue
            if getattr(param, "_fsdp_flattened", False):
                raise ValueError(
                    f"parameter {raw!r} is an FSDP1 flat shard whose FullyShardedDataParallel unit is outside "
                    f"the module given ({type(self.module).__name__}): pass the module holding the FSDP root "
                    "(Lightning: trainer.strategy.model; Accelerate: the model accelerator.prepare returned, "
                    "not accelerator.unwrap_model(model))"
                )
            name = self._selected(raw)
            if name is not None:
                plain[name] = param
                metas.append(ParamMeta(name, param.dtype, tuple(param.shape)))
        return units, plain, metas

    def parameters(self) -> list[ParamMeta]:
        return list(self._metas)

    def frozen(self) -> set[str]:
        """A unit's original parameters where FSDP keeps them
        (``use_orig_params=True``), else its flat parameter, which FSDP1
        makes of parameters that all train or all do not."""
        found = {name for name, p in self._plain.items() if not p.requires_grad}
        for unit in self._units:
            flat = unit.fsdp._handle.flat_param
            for name, index in zip(unit.names, unit.indices):
                if not (flat._params[index] if flat._params else flat).requires_grad:
                    found.add(name)
        return found

    def gather(self, names: Sequence[str], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        wanted = set(names)
        # Factors held by other units than their weight's: gathered when a
        # weight first needs them, kept (copied out of their unit's buffer)
        # only until the last weight needing them is merged.
        uses = Counter(f for n in names if n in self.merges for f in self.merges[n].factors)
        ahead: dict[str, torch.Tensor] = {}
        for position, unit in enumerate(self._units):
            picked = [(n, i) for n, i in zip(unit.names, unit.indices) if n in wanted]
            if not picked:
                continue
            merges = [self.merges[n] for n, _ in picked if n in self.merges]
            if not merges:
                originals = _unshard(unit.fsdp, dtype)
                for name, index in picked:
                    yield name, originals[index]
                del originals
                continue
            # A unit holding LoRA-targeted weights is gathered in its own
            # dtype: they are merged in float32, then cast. Their factors may
            # sit in other units (PEFT's auto-wrap policy wraps each factor):
            # those are gathered first, on every rank in the same order.
            missing = {f for m in merges for f in m.factors} - set(unit.names) - set(ahead)
            if missing:
                ahead.update(self._factors_elsewhere(missing, position, uses))
            originals = _unshard(unit.fsdp, None)
            held = {**ahead, **{n: originals[i] for n, i in zip(unit.names, unit.indices)}}
            for name, index in picked:
                merge = self.merges.get(name)
                if merge is None:
                    yield name, in_wire_dtype(originals[index], dtype)
                    continue
                yield name, merge.full(originals[index], held).to(dtype if dtype is not None else originals[index].dtype)
                _release(merge, uses, ahead)
            del originals, held
        for name in names:
            if name in self._plain:
                merge = self.merges.get(name)
                tensor = self._plain[name].detach()
                if merge is None:
                    yield name, in_wire_dtype(tensor, dtype)
                    continue
                missing = {f for f in merge.factors if f not in self._plain and f not in ahead}
                if missing:
                    ahead.update(self._factors_elsewhere(missing, -1, uses))
                held = {**ahead, **{f: self._plain[f].detach() for f in merge.factors if f in self._plain}}
                yield name, merge.full(tensor, held).to(dtype if dtype is not None else tensor.dtype)
                _release(merge, uses, ahead)

    def _factors_elsewhere(self, factors: set[str], position: int, uses: Counter[str]) -> dict[str, torch.Tensor]:
        """The LoRA factors ``factors`` held by units other than the one at
        ``position``, gathered now (in their own dtype), a unit at a time,
        with every other factor such a unit holds that a later merge needs
        (``uses``): a unit is gathered once per round. Copies: the units'
        buffers are freed."""
        found: dict[str, torch.Tensor] = {}
        for at, unit in enumerate(self._units):
            if at == position or not factors.intersection(unit.names):
                continue
            originals = _unshard(unit.fsdp, None)
            found.update({n: originals[i].clone() for n, i in zip(unit.names, unit.indices) if uses[n] > 0})
            del originals
        return found


def _release(merge: Merge, uses: Counter[str], ahead: dict[str, torch.Tensor]) -> None:
    """One merge done: drop the factors no later merge needs."""
    for factor in merge.factors:
        uses[factor] -= 1
        if uses[factor] <= 0:
            ahead.pop(factor, None)


def _unshard(unit: torch.nn.Module, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """The unit's original parameters, full and in the wire dtype: views into
    one buffer gathered for this call (a collective over the unit's group)."""
    from torch.distributed.fsdp._common_utils import TrainingState
    from torch.distributed.fsdp._flat_param import HandleTrainingState

    handle = unit._handle
    if unit.training_state != TrainingState.IDLE or handle._training_state != HandleTrainingState.IDLE:
        raise RuntimeError(
            "an FSDP1 unit is inside forward/backward or summon_full_params: sync between optimizer steps"
        )
    flat = handle.flat_param
    if handle.uses_sharded_strategy:
        # The padded local shard, in full precision even under MixedPrecision
        # (and on the CPU under CPU offload), whether or not the unit is
        # still unsharded after a forward. FSDP1 records it at its lazy
        # init (first forward); before that the flat parameter is the shard.
        shard = in_wire_dtype(getattr(flat, "_local_shard", flat).detach().to(handle.device), dtype)
        group = handle.process_group
        world = dist.get_world_size(group)
        full = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
        if shard.is_cpu:
            dist.all_gather(list(full.chunk(world)), shard, group=group)
        else:
            dist.all_gather_into_tensor(full, shard, group=group)
        del shard
        full = full[: flat._unpadded_unsharded_size.numel()]
    else:
        # NO_SHARD: whole on every rank. Without a cast these are views of the
        # live parameter, unchanged during a round, as LocalParameters yields.
        full = in_wire_dtype(flat.detach(), dtype)
    originals = []
    for piece, padding in zip(torch.split(full, flat._numels_with_padding), flat._is_padding_mask):
        if padding:
            continue
        i = len(originals)
        shape = flat._shapes[i]
        originals.append(piece.view(shape) if flat._contiguities[i] else piece.as_strided(shape, flat._strides[i]))
    return originals
