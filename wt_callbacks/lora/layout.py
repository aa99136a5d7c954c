"""Where a PEFT model keeps its base weights and its adapters, found from its modules.

A PEFT model holds the base model's weights under other names than the
checkpoint's (``base_model.model.`` in front, ``.base_layer.`` inside every
targeted module, ``modules_to_save.<adapter>.`` for trained copies) and adds
the adapter's own tensors beside them. ``LoraLayout.of(root)`` reads that
structure from the module tree, the way PEFT builds it, not from name
patterns: the collapsing of ``base_layer`` / ``base_model.model`` follows the
PEFT classes that own those attributes, so ``get_peft_model``,
``inject_adapter_in_model`` and transformers' ``add_adapter`` (no
``base_model.model.`` prefix) read the same, through any wrapper the
training framework put around them (names are checkpoint names,
``wt_callbacks.naming``).

It answers, from names and module attributes only (no tensor is read, so it
works on sharded models):

* merge mode: every kept parameter's base name, the ``Merge`` of each
  LoRA-targeted base tensor (its factors, their scaling read live), and the
  names that are not sent (the factors, ``original_module`` behind an active
  ``modules_to_save`` copy, inactive copies);
* adapter mode: the LoRA layers and trained copies of the active adapter
  (what ``saved`` names as PEFT saves them);
* what each mode cannot send, raised at setup naming the other mode or the
  fix (``check_merge``, ``check_adapter``).

Only the adapters a layer has active count, as in PEFT's forward; adapters
merged into the base weights in place (``merge_adapter``) are already in
them. ``state()`` changes when that changes (``set_adapter``,
``disable_adapter``), so a source re-plans.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from wt_callbacks.lora.merge import BIAS, EXPERTS, LINEAR, TRANSPOSED, Merge, Term
from wt_callbacks.naming import checkpoint_name

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the base model's names in a saved adapter."""


def _peft() -> Any:
    """The ``peft`` module if this process imported it (a PEFT model exists only then)."""
    return sys.modules.get("peft")


def is_peft_model(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds PEFT layers. Never imports PEFT."""
    if _peft() is None:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return any(isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper)) for m in module.modules())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class _Role:
    """What a module of the PEFT model is: part of the base model (at ``base``), an
    adapter's own (``factor``), or not sent (``dropped``)."""

    kind: str  # "base" | "factor" | "dropped" | "copies"
    base: str = ""
    wrapper: Any = None  # the ModulesToSaveWrapper of "copies"


@dataclass
class LoraLayout:
    """A PEFT model's names, merges and adapter tensors (see the module docstring).

    Build with ``LoraLayout.of(root)`` (``None`` when ``root`` holds no PEFT
    layer). Names are checkpoint names relative to ``root``, as the sources
    hold them.
    """

    root: torch.nn.Module
    roles: dict[str, _Role]
    merges: dict[str, Merge]
    """Base tensor name -> how it is merged (merge mode)."""
    layers: list[tuple[str, Any]]
    """Every LoRA layer, with its path."""
    wrappers: list[tuple[str, Any]]
    """Every ``modules_to_save`` / trainable-tokens wrapper, with its path."""
    model_prefix: str
    """Path of the base (transformers) model within ``root``: what PEFT's saved names replace by ``base_model.model.``."""
    base_model: Any
    problems: dict[str, list[str]] = field(default_factory=dict)
    """Per mode (``"merge"``, ``"adapter"``, ``"both"``), why it cannot be sent."""
    targeted: set[str] = field(default_factory=set)
    """The base tensors of every LoRA layer, whatever its adapters' state: what
    an adapter may have changed (``merge_adapter`` merges in place, and an
    unmerge does not give the bits back), so never a frozen tensor to keep."""

    @classmethod
    def of(cls, root: torch.nn.Module) -> LoraLayout | None:
        if not is_peft_model(root):
            return None
        from peft.tuners.lora import LoraLayer
        from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

        innermost: dict[str, Any] = {}
        path_of: dict[int, str] = {}
        roles: dict[str, _Role] = {}
        layers: list[tuple[str, Any]] = []
        wrappers: list[tuple[str, Any]] = []
        foreign: list[str] = []
        tuner_model: Any = None
        for raw, module in root.named_modules():
            path = checkpoint_name(raw)
            innermost[path] = module
            path_of[id(module)] = path
            if not path:
                roles[path] = _Role("base", "")
            else:
                parent_path, _, leaf = path.rpartition(".")
                roles[path] = _child_role(roles[parent_path], innermost[parent_path], leaf, module)
            if isinstance(module, BaseTuner) and tuner_model is None:
                tuner_model = module.model
            if isinstance(module, LoraLayer):
                layers.append((path, module))
            elif isinstance(module, BaseTunerLayer):
                foreign.append(f"{path} ({type(module).__name__})")
            elif isinstance(module, AuxiliaryTrainingWrapper):
                wrappers.append((path, module))
        base_model = tuner_model if tuner_model is not None else _outermost_transformers_model(root)
        model_prefix = path_of.get(id(base_model), "") if base_model is not None else ""
        layout = cls(root, roles, {}, layers, wrappers, model_prefix, base_model)
        if foreign:
            layout._problem("both", f"PEFT layers of a method other than LoRA ({foreign[0]}): weight sync sends LoRA adapters")
        embeddings = _embedding_modules(base_model)
        tied = _ties_embeddings(base_model)
        for path, layer in layers:
            layout._add_layer(path, layer, path_of, embeddings, tied)
        for path, wrapper in wrappers:
            if not isinstance(wrapper, ModulesToSaveWrapper):
                layout._problem(
                    "both",
                    f"{path} is a {type(wrapper).__name__} (trainable_token_indices): its trained rows are not "
                    "sent; train the embedding with modules_to_save or a LoRA on it instead",
                )
            elif tied and (id(wrapper) in embeddings or id(wrapper.original_module) in embeddings):
                layout._problem(
                    "merge",
                    f"modules_to_save holds {path}, an embedding tied to the output head "
                    "(tie_word_embeddings): a server ties them again and would serve the trained copy on both "
                    "sides. Untie the checkpoint (tie_word_embeddings=False)",
                )
        return layout

    # -- what each mode cannot do --------------------------------------------

    def _problem(self, mode: str, message: str) -> None:
        self.problems.setdefault(mode, []).append(message)

    def check_merge(self) -> None:
        """Raise ``ValueError`` naming what ``lora: merge`` cannot send."""
        problems = self.problems.get("both", []) + self.problems.get("merge", [])
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ValueError(f"lora: merge: {problems[0]}{more}")

    def check_adapter(self) -> None:
        """Raise ``ValueError`` naming what ``lora: adapter`` cannot send (what vLLM cannot serve as an adapter)."""
        problems = self.problems.get("both", []) + self.problems.get("adapter", [])
        active = self.active_adapters()
        if not active:
            problems.insert(0, "no LoRA adapter is active (set_adapter / enable the adapters): nothing to send")
        elif len(active) > 1:
            problems.insert(
                0,
                f"several adapters are active ({sorted(active)}), and a server applies one adapter per request: "
                "activate one (set_adapter), or use lora: merge, which merges them all",
            )
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ValueError(f"lora: adapter: {problems[0]}{more}")

    # -- merge mode ------------------------------------------------------------

    def _add_layer(self, path: str, layer: Any, path_of: dict[int, str], embeddings: set[int], tied: bool) -> None:
        from peft.tuners.lora import layer as lora_layers

        Embedding, Linear = lora_layers.Embedding, lora_layers.Linear
        ParamWrapper = getattr(lora_layers, "ParamWrapper", ())  # noqa: N806 - PEFT >= 0.17 (target_parameters)

        base = layer.get_base_layer()
        base_path = path_of.get(id(base))
        if base_path is not None:
            attrs = (layer.parameter_name,) if isinstance(layer, ParamWrapper) else ("weight", "bias")
            self.targeted.update(_join(base_path, a) for a in attrs)
        adapters = self.applied_adapters(layer)
        kind_name = type(layer).__name__
        quantized = _quantized(base)
        if quantized:
            self._problem(
                "merge",
                f"{path} has a quantized base ({quantized}): merging rounds the update into the quantized grid "
                "(and is impossible on sharded 4-bit weights). Use lora: adapter",
            )
        on_embedding = id(layer) in embeddings or id(base) in embeddings
        if on_embedding and tied and adapters:
            self._problem(
                "merge",
                f"a LoRA on {path}, an embedding tied to the output head (tie_word_embeddings): PEFT applies it "
                "to one side only, while a merged tensor would change both (PEFT's own merge moved logits by "
                "whole nats). Use lora: adapter, which vLLM serves exactly, or untie the checkpoint",
            )
        if getattr(layer, "fan_in_fan_out", False):
            self._problem(
                "adapter",
                f"{path} is a fan-in-fan-out layer ({type(base).__name__}, as GPT-2's Conv1D): vLLM serves no "
                "LoRA on such models. Use lora: merge",
            )
        for adapter in adapters:
            variant = getattr(layer, "lora_variant", {}).get(adapter)
            name = type(variant).__name__ if variant is not None else ""
            if variant is not None and name != "DoraLinearVariant":
                self._problem("both", f"{path} uses a LoRA variant weight sync does not merge ({name})")
            if name:
                self._problem("adapter", f"{path} uses DoRA, which vLLM does not serve as an adapter. Use lora: merge")
            if layer.lora_bias.get(adapter, False):
                self._problem("adapter", f"{path} has lora_bias=True, which vLLM does not serve. Use lora: merge")
        if base_path is None or not adapters:
            return
        if isinstance(layer, ParamWrapper):
            base_name = _join(base_path, layer.parameter_name)
            experts = int(layer.num_experts)
            kind = EXPERTS if experts > 1 else LINEAR
            terms = tuple(Term(layer, a, f"{path}.lora_A.{a}.weight", f"{path}.lora_B.{a}.weight") for a in adapters)
            self.merges[base_name] = Merge(
                base_name, kind, terms, experts=experts, swapped=bool(getattr(layer, "_did_swap_in_out_features", False))
            )
            return
        if isinstance(layer, Embedding):
            terms = tuple(Term(layer, a, f"{path}.lora_embedding_A.{a}", f"{path}.lora_embedding_B.{a}") for a in adapters)
            if any(a in getattr(layer, "lora_magnitude_vector", {}) for a in adapters):
                self._problem("both", f"{path} uses DoRA on an embedding, which weight sync does not merge")
            self.merges[_join(base_path, "weight")] = Merge(_join(base_path, "weight"), TRANSPOSED, terms)
            return
        if type(layer) is not Linear:
            # A quantized base (bitsandbytes' LoRA layers) is refused for merge
            # above; its adapter is a plain one (QLoRA), sent as PEFT saves it.
            if not quantized:
                self._problem("both", f"{path} is a LoRA layer of a kind weight sync does not merge ({kind_name})")
            return
        terms = tuple(Term(layer, a, f"{path}.lora_A.{a}.weight", f"{path}.lora_B.{a}.weight") for a in adapters)
        dora = [a for a in adapters if a in layer.lora_magnitude_vector]
        if dora and len(adapters) > 1:
            self._problem("merge", f"{path} has several active adapters with DoRA; activate one (set_adapter)")
        magnitude = f"{path}.lora_magnitude_vector.{dora[0]}.weight" if dora else None
        kind = TRANSPOSED if layer.fan_in_fan_out else LINEAR
        weight = _join(base_path, "weight")
        self.merges[weight] = Merge(weight, kind, terms, magnitude=magnitude)
        biased = tuple(Term(layer, a, None, f"{path}.lora_B.{a}.bias") for a in adapters if layer.lora_bias.get(a, False))
        if biased:
            bias = _join(base_path, "bias")
            self.merges[bias] = Merge(bias, BIAS, biased)

    @staticmethod
    def applied_adapters(layer: Any) -> list[str]:
        """The adapters a LoRA layer applies on top of its base weight: active,
        present in the layer, not merged into the weight in place already."""
        if layer.disable_adapters:
            return []
        present = set(layer.lora_A) | set(layer.lora_embedding_A)
        return [a for a in layer.active_adapters if a in present and a not in layer.merged_adapters]

    def module_base(self, path: str) -> str | None:
        """The base model's path of module ``path``, ``None`` for a module an adapter owns or that is not sent."""
        role = self.roles.get(path)
        if role is None:
            return path
        return role.base if role.kind == "base" else None

    def base_name(self, name: str) -> str | None:
        """The name ``name`` (a parameter as the source holds it) is sent under
        in merge mode, or ``None`` when it is not sent (an adapter's own tensor,
        an ``original_module`` behind an active copy, an inactive copy)."""
        path, _, attr = name.rpartition(".")
        role = self.roles.get(path)
        if role is None:  # a module path FSDP or a framework left out of named_modules
            return name
        return _join(role.base, attr) if role.kind == "base" else None

    def state(self) -> tuple[Any, ...]:
        """What decides the plan besides the parameters: each layer's active,
        merged and disabled adapters and their scaling (read live)."""
        return tuple(
            (path, tuple(layer.active_adapters), tuple(layer.merged_adapters), bool(layer.disable_adapters))
            for path, layer in self.layers
        ) + tuple((path, tuple(w.active_adapters), bool(w.disable_adapters)) for path, w in self.wrappers)

    @property
    def moe(self) -> bool:
        """Whether the base model has MoE experts (a module named ``experts``)."""
        return any(path == "experts" or path.endswith(".experts") for path in self.roles)

    # -- adapter mode ---------------------------------------------------------

    def active_adapters(self) -> set[str]:
        """The adapters some layer applies (PEFT's forward), copies of ``modules_to_save`` included."""
        found = {a for _, layer in self.layers for a in self.applied_adapters(layer)}
        copies = (_active_copy(w) for _, w in self.wrappers if hasattr(w, "modules_to_save"))
        return found | {c for c in copies if c is not None}


def _child_role(parent: _Role, parent_module: Any, leaf: str, module: Any) -> _Role:
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    if parent.kind in ("factor", "dropped"):
        return parent
    if parent.kind == "copies":
        wrapper = parent.wrapper
        return _Role("base", parent.base) if leaf == _active_copy(wrapper) else _Role("dropped")
    if isinstance(module, BaseTuner) or (isinstance(parent_module, BaseTuner) and leaf == "model"):
        return _Role("base", parent.base)
    if isinstance(parent_module, BaseTunerLayer):
        return _Role("base", parent.base) if leaf == "base_layer" else _Role("factor")
    if isinstance(parent_module, ModulesToSaveWrapper):
        if leaf == "modules_to_save":
            return _Role("copies", parent.base, parent_module)
        if leaf == "original_module":
            return _Role("dropped") if _active_copy(parent_module) else _Role("base", parent.base)
    if isinstance(parent_module, AuxiliaryTrainingWrapper):
        return _Role("base", parent.base) if leaf == "original_module" else _Role("factor")
    return _Role("base", _join(parent.base, leaf))


def _active_copy(wrapper: Any) -> str | None:
    """The ``modules_to_save`` copy PEFT's forward uses, or ``None`` (the original)."""
    if wrapper.disable_adapters or not wrapper.active_adapters:
        return None
    name = wrapper.active_adapters[0]
    return name if name in wrapper.modules_to_save else None


def _outermost_transformers_model(root: torch.nn.Module) -> Any:
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    return next((m for m in root.modules() if isinstance(m, transformers.PreTrainedModel)), None)


def _embedding_modules(model: Any) -> set[int]:
    """ids of the model's input and output embeddings, their PEFT wrappers and the modules inside them."""
    found: set[int] = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)() if model is not None else None
        while module is not None:
            found.add(id(module))
            module = getattr(module, "base_layer", None) or getattr(module, "original_module", None)
    return found


def _ties_embeddings(model: Any) -> bool:
    config = getattr(model, "config", None)
    if config is None:
        return False
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    return bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def _quantized(base: Any) -> str:
    """Why ``base``'s weight is quantized (its class, or its dtype), or ``""``."""
    name = type(base).__name__
    if name in ("Linear4bit", "Linear8bitLt") or "quant" in type(base).__module__:
        return name
    weight = getattr(base, "weight", None)
    if weight is not None and (not weight.is_floating_point() or hasattr(weight, "quant_state")):
        return f"{name} holding {str(weight.dtype).removeprefix('torch.')} weights"
    return ""
