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
* adapter mode: the active adapter's tensors under the names PEFT saves them
  with (``get_peft_model_state_dict``: ``base_model.model.`` first, the
  adapter name left out) and its ``adapter_config.json``;
* what each mode cannot send, raised at setup naming the other mode or the
  fix (``check_merge``, ``check_adapter``).

Only the adapters a layer has active count, as in PEFT's forward; adapters
merged into the base weights in place (``merge_adapter``) are already in
them. ``state()`` changes when that changes (``set_adapter``,
``disable_adapter``), so a source re-plans.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from wt_callbacks.lora.merge import BIAS, EXPERTS, LINEAR, TRANSPOSED, Merge, Term
from wt_callbacks.naming import checkpoint_name

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the base model's names in a saved adapter."""
VLLM_MODULES_TO_SAVE = ("classifier", "score")
"""The only ``modules_to_save`` vLLM serves in an adapter (``PEFTHelper``)."""
FACTOR_ATTRS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


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
        adapters = self._merged_adapters(layer)
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
    def _merged_adapters(layer: Any) -> list[str]:
        """The adapters whose delta a merge adds: active, present in the layer, not merged in place already."""
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

    def moved_by_lora(self) -> set[str]:
        """Base names of the tensors a merge changes: the rest of a PEFT model
        is frozen unless something outside LoRA trains it."""
        return {self.base_name(n) or n for n in self.merges}

    # -- adapter mode ---------------------------------------------------------

    def active_adapters(self) -> set[str]:
        """The adapters some layer applies (PEFT's forward), copies of ``modules_to_save`` included."""
        found = {a for _, layer in self.layers for a in self._merged_adapters(layer)}
        return found | {c for _, w in self.wrappers if isinstance(c := _active_copy_or_none(w), str)}

    def adapter_tensors(self, names: Iterable[str]) -> list[tuple[str, str]]:
        """``(name as held, name as PEFT saves it)`` of the active adapter's
        tensors among ``names`` (the source's parameters), in their order.

        Raises:
            ValueError: what ``check_adapter`` raises, and ``modules_to_save``
                on modules vLLM serves no copy of.
        """
        self.check_adapter()
        (adapter,) = self.active_adapters()
        factor_names = {
            n: self.saved_name(n, adapter)
            for path, layer in self.layers
            if adapter in self._merged_adapters(layer)
            for n in (
                (f"{path}.lora_embedding_A.{adapter}", f"{path}.lora_embedding_B.{adapter}")
                if adapter in layer.lora_embedding_A
                else (f"{path}.lora_A.{adapter}.weight", f"{path}.lora_B.{adapter}.weight")
            )
        }
        copies: dict[str, str] = {}
        for path, wrapper in self.wrappers:
            if adapter not in getattr(wrapper, "modules_to_save", {}):
                continue
            if path.rpartition(".")[2] not in VLLM_MODULES_TO_SAVE:
                raise ValueError(
                    f"lora: adapter: modules_to_save holds {path}, and vLLM serves only {list(VLLM_MODULES_TO_SAVE)} "
                    "as trained copies in an adapter. Use lora: merge"
                )
            prefix = f"{path}.modules_to_save.{adapter}."
            copies.update({n: self.saved_name(n, adapter) for n in names if n.startswith(prefix)})
        wanted = {**factor_names, **copies}
        return [(n, wanted[n]) for n in names if n in wanted]

    def saved_name(self, name: str, adapter: str) -> str:
        """``name`` as ``save_pretrained`` of the PEFT model writes it (``base_model.model.`` first, no adapter name)."""
        local = name[len(self.model_prefix) + 1 :] if self.model_prefix else name
        parts = local.split(".")
        out: list[str] = []
        skip = False
        for i, part in enumerate(parts):
            if skip:
                skip = False
                continue
            if part in FACTOR_ATTRS and i + 1 < len(parts) and parts[i + 1] == adapter:
                out.append(part)
                skip = True
                continue
            if part == "modules_to_save" and i + 1 < len(parts) and parts[i + 1] == adapter:
                skip = True
                continue
            out.append(part)
        return PEFT_PREFIX + ".".join(out)

    def max_rank(self) -> int:
        """The largest rank of the active adapter (what vLLM's ``--max-lora-rank`` must cover)."""
        return max((int(layer.r[a]) for _, layer in self.layers for a in self._merged_adapters(layer)), default=0)

    def adapter_config(self) -> dict[str, Any]:
        """The active adapter's ``adapter_config.json``: PEFT's config, plus
        per-module ``rank_pattern`` / ``alpha_pattern`` taken from the live
        layers, so a server computes the scaling the trainer's layers apply
        (``set_scale`` included) whatever PEFT's pattern rules made of the
        config."""
        (adapter,) = self.active_adapters()
        config = _find_peft_config(self.root, adapter)
        data = json.loads(json.dumps(config.to_dict(), default=_json_value))
        ranks: dict[str, int] = {}
        alphas: dict[str, float] = {}
        rslora = bool(data.get("use_rslora", False))
        for path, layer in self.layers:
            if adapter not in self._merged_adapters(layer):
                continue
            module = self.saved_name(path, adapter).removeprefix(PEFT_PREFIX)
            parameter = getattr(layer, "parameter_name", None)
            if parameter is not None:  # vLLM matches experts' patterns against the parameter's name
                module = _experts_pattern_name(module, parameter)
            r = int(layer.r[adapter])
            ranks[re.escape(module)] = r
            alphas[re.escape(module)] = float(layer.scaling[adapter]) * (math.sqrt(r) if rslora else r)
        data["rank_pattern"], data["alpha_pattern"] = ranks, alphas
        data["r"] = max(ranks.values(), default=int(data.get("r", 8)))
        return data


def _experts_pattern_name(module: str, parameter: str) -> str:
    """The module name vLLM matches a packed-experts LoRA's patterns against
    (``PEFTHelper.get_rank_and_scaling``): ``...experts.gate_up_proj`` for the
    wrapper saved as ``...experts.base_layer``, ``...experts.down_proj`` for ``...experts``."""
    return f"{module.removesuffix('.base_layer')}.{parameter}"


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


def _active_copy_or_none(wrapper: Any) -> str | None:
    return _active_copy(wrapper) if hasattr(wrapper, "modules_to_save") else None


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


def _find_peft_config(root: torch.nn.Module, adapter: str) -> Any:
    for module in root.modules():
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict) and adapter in configs:
            return configs[adapter]
    raise ValueError(f"lora: adapter: no peft_config for adapter {adapter!r} in the module")


def _json_value(value: Any) -> Any:
    """What PEFT's own ``save_pretrained`` writes for the config's non-JSON values."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "value"):  # enums (PeftType, TaskType)
        return value.value
    raise TypeError(f"cannot write {type(value).__name__} into adapter_config.json")
