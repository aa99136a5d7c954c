"""Checkpoint format: the tensors ``save_pretrained`` would write, one group at a time.

transformers 5 holds some weights in memory in another layout than its
checkpoints: a Qwen3-MoE layer keeps its experts packed as
``mlp.experts.gate_up_proj`` (E, 2I, H), while the checkpoint, and every
server loading it (vLLM's ``load_weights`` included), names them
``mlp.experts.{e}.gate_proj.weight``. Sending ``named_parameters()`` as they
are puts tensors on the wire that a server may accept under the wrong layout
and serve garbage. So the trainer sends the checkpoint format, and the
reference receiver takes it in again, as ``from_pretrained`` does.

The mapping is transformers' own: the weight conversions the model was
loaded with (``model._weight_conversions``) or, for a model built from a
config, its registered conversion mapping, the very transforms
``save_pretrained`` reverts. No table per architecture lives here, so a new
architecture works as soon as transformers supports it.

Conversions are applied per *group*: the in-memory tensors one transform
needs together (one packed expert tensor; q, k and v when a model fuses them
on load), so memory stays bounded by the largest group, never a copy of the
model. The plan of groups is computed on meta tensors from names and shapes
alone, so ``metadata()`` never gathers and a conversion transformers cannot
reverse fails at setup, naming the parameter.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wt_callbacks.transfer.weight_source import ParamMeta


@dataclass(frozen=True)
class ConversionGroup:
    """In-memory tensors converted together and the checkpoint tensors they become.

    Attributes:
        inputs: in-memory names, in stream order (the group is complete at the last).
        outputs: the checkpoint tensors, in the order they are sent.
        converted: a transform changes the tensors (not only their names).
    """

    inputs: tuple[str, ...]
    outputs: tuple[ParamMeta, ...]
    converted: bool


def is_transformers_model(module: torch.nn.Module) -> bool:
    # Only a process that built a transformers model has imported it; never
    # import it here for a module that is not one.
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def _reverse_of(transform: Any) -> Any:
    """``transform.reverse_transform()``, or, for a transform without a
    reverse, one that fails when a tensor it covers is converted: the plan
    then names that parameter, and only models that use it are refused."""
    try:
        return transform.reverse_transform()
    except Exception as e:  # noqa: BLE001 - any reason is reported per parameter
        from transformers.core_model_loading import ConversionOps

        reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

        class CannotReverse(ConversionOps):
            def convert(self, input_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
                raise NotImplementedError(f"{transform!r} has no reverse ({reason})")

        return transform.copy(
            transform._original_target_patterns, transform._original_source_patterns, operations=[CannotReverse()]
        )


class CheckpointFormat:
    """The weight conversions of one transformers model, in both directions.

    Build with ``CheckpointFormat.of(model)``, which returns ``None`` when
    there is nothing to convert (not a transformers model, or one whose
    memory layout is its checkpoint's, as for Llama).
    """

    def __init__(self, model: torch.nn.Module, transforms: list[Any]) -> None:
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        self.model = model
        self._kinds = (WeightConverter, WeightRenaming)
        self._forward = transforms
        # Reverted last-applied first, as save_pretrained does, so that
        # conversions of sub-models apply before those of their parents.
        self._reverse = [_reverse_of(t) for t in transforms[::-1]]
        self._reverse_converters = [t for t in self._reverse if isinstance(t, WeightConverter)]

    @classmethod
    def of(cls, model: torch.nn.Module) -> CheckpointFormat | None:
        if not is_transformers_model(model):
            return None
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange

        transforms = getattr(model, "_weight_conversions", None)
        if transforms is None:
            # Built from a config, not loaded: what save_pretrained then
            # reverts. A prefix change would only be known from a checkpoint.
            transforms = [
                t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)
            ]
        return cls(model, list(transforms)) if transforms else None

    # -- planning (names and shapes only) ------------------------------------

    def plan(self, metas: Sequence[ParamMeta]) -> list[ConversionGroup]:
        """The groups of ``metas`` (in-memory, stream order), in completion order.

        Raises:
            ValueError: naming the parameter whose conversion transformers
                cannot reverse.
        """
        key_of = {m.name: self._group_key(m.name) for m in metas}
        members: dict[str, list[ParamMeta]] = {}
        for m in metas:
            members.setdefault(key_of[m.name][0], []).append(m)
        left = {key: len(group) for key, group in members.items()}
        groups = []
        for m in metas:
            key, converted = key_of[m.name]
            left[key] -= 1
            if left[key]:
                continue
            inputs = members[key]
            meta_tensors = {i.name: torch.empty(i.shape, dtype=i.dtype, device="meta") for i in inputs}
            try:
                outputs = self._apply(meta_tensors, reverse=True)
            except Exception as e:
                raise ValueError(
                    f"cannot send {inputs[0].name!r} in checkpoint format: transformers' conversion of "
                    f"{type(self.model).__name__} does not reverse ({type(e).__name__}: {e}). Exclude it "
                    "(exclude: [...]) or send a module whose memory layout is its checkpoint's"
                ) from e
            groups.append(
                ConversionGroup(
                    inputs=tuple(i.name for i in inputs),
                    outputs=tuple(ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in outputs.items()),
                    converted=converted,
                )
            )
        return groups

    def _group_key(self, name: str) -> tuple[str, bool]:
        """The name of the transform instance ``name`` feeds, and whether it converts."""
        from transformers.core_model_loading import apply_converters

        renamed, pattern = apply_converters(name, self._reverse_converters)
        return (renamed, True) if pattern is not None else (name, False)

    # -- streaming ------------------------------------------------------------

    def to_checkpoint(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """In-memory tensors (whole groups) as the checkpoint tensors
        ``save_pretrained`` writes for them."""
        return self._apply(dict(tensors), reverse=True)

    def from_checkpoint(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors (whole groups) in the model's memory layout, as
        ``from_pretrained`` converts them."""
        return self._apply(dict(tensors), reverse=False)

    def _apply(self, tensors: dict[str, torch.Tensor], *, reverse: bool) -> dict[str, torch.Tensor]:
        """Run the transforms over ``tensors`` (whole groups), the way
        transformers does: on load renamings then one converter per name, on
        save the reverse (one converter, then renamings)."""
        from transformers.core_model_loading import apply_converters, apply_renamings, dot_natural_key

        converter_cls, renaming_cls = self._kinds
        transforms = self._reverse if reverse else self._forward
        renamings = [t for t in transforms if isinstance(t, renaming_cls)]
        converters = [t for t in transforms if isinstance(t, converter_cls)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        pending: dict[str, Any] = {}
        out: dict[str, torch.Tensor] = {}
        for key, tensor in sorted(tensors.items(), key=lambda kv: dot_natural_key(kv[0])):
            renamed, pattern = apply_converters(key if reverse else apply_renamings(key, renamings), converters)
            if pattern is None:
                out[apply_renamings(renamed, renamings) if reverse else renamed] = tensor
                continue
            # Each transform instance collects the tensors of one target.
            pending.setdefault(renamed, copy.deepcopy(by_pattern[pattern])).add_tensor(renamed, key, pattern, tensor)
        for first, converter in pending.items():
            for name, value in converter.convert(first, model=self.model, config=self.model.config).items():
                out[apply_renamings(name, renamings) if reverse else name] = value[0] if isinstance(value, list) else value
        return out


class CheckpointLayout:
    """How the parameters of a module map onto checkpoint tensors.

    Covers modules that merely contain transformers models (a
    LightningModule holding one at ``self.model``): each outermost
    transformers model converts the names under its path; everything else is
    sent as it is. Groups carry full names.

    ``rename`` maps a module's checkpoint path to the one the sent names use
    (a PEFT model's base path, ``LoraLayout.module_base``; ``None``: a module
    that is not sent).
    """

    def __init__(self, root: torch.nn.Module, rename: Callable[[str], str | None] | None = None) -> None:
        from wt_callbacks.naming import checkpoint_name

        self.formats: list[tuple[str, CheckpointFormat]] = []
        claimed: list[str] = []
        for raw, sub in root.named_modules():
            name = checkpoint_name(raw) if rename is None else rename(checkpoint_name(raw))
            if name is None:
                continue
            # A model's conversions cover its sub-models (a vision tower, say):
            # only the outermost transformers model of a subtree counts.
            if any(c == "" or name == c or name.startswith(c + ".") for c in claimed):
                continue
            if not is_transformers_model(sub):
                continue
            claimed.append(name)
            fmt = CheckpointFormat.of(sub)
            if fmt is not None:
                self.formats.append((f"{name}." if name else "", fmt))

    def plan(self, metas: Sequence[ParamMeta]) -> list[ConversionGroup]:
        """Groups of ``metas`` (checkpoint-named parameters in stream order),
        ordered by their last input's position."""
        owner = [next((i for i, (p, _) in enumerate(self.formats) if m.name.startswith(p)), None) for m in metas]
        groups = [ConversionGroup((m.name,), (m,), False) for m, o in zip(metas, owner) if o is None]
        for i, (prefix, fmt) in enumerate(self.formats):
            local = [ParamMeta(m.name[len(prefix) :], m.dtype, m.shape) for m, o in zip(metas, owner) if o == i]
            groups += [
                ConversionGroup(
                    tuple(prefix + n for n in g.inputs),
                    tuple(ParamMeta(prefix + o.name, o.dtype, o.shape) for o in g.outputs),
                    g.converted,
                )
                for g in fmt.plan(local)
            ]
        position = {m.name: i for i, m in enumerate(metas)}
        groups.sort(key=lambda g: position[g.inputs[-1]])
        return groups

    def to_checkpoint(self, group: ConversionGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One group's in-memory tensors as its checkpoint tensors."""
        return self._convert(group, tensors, reverse=True)

    def to_memory(self, group: ConversionGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One group's checkpoint tensors in the model's memory layout (``from_pretrained``'s direction)."""
        return self._convert(group, tensors, reverse=False)

    def _convert(self, group: ConversionGroup, tensors: Mapping[str, torch.Tensor], *, reverse: bool) -> dict[str, torch.Tensor]:
        if not group.converted:
            (name,) = (o.name for o in group.outputs) if reverse else group.inputs
            return {name: next(iter(tensors.values()))}
        prefix, fmt = next((p, f) for p, f in self.formats if group.inputs[0].startswith(p))
        local = {n[len(prefix) :]: t for n, t in tensors.items()}
        out = fmt.to_checkpoint(local) if reverse else fmt.from_checkpoint(local)
        return {prefix + n: t for n, t in out.items()}
