"""What PEFT's ``save_pretrained`` writes for the active adapter: its tensors' names and ``adapter_config.json``.

``lora: adapter`` sends the adapter in that form, since vLLM loads adapters
as PEFT saves them (``base_model.model.`` in front of the module path, the
adapter name left out: ``...q_proj.lora_A.weight``), and reads the scaling
from the config, by PEFT's rules. The config written here carries, besides
PEFT's own, one ``rank_pattern`` / ``alpha_pattern`` entry per module taken
from the live layers, so a server applies exactly the scaling the trainer's
layers apply (``set_scale`` included), whatever the config's patterns say.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any

import torch

from wt_callbacks.lora.layout import PEFT_PREFIX, LoraLayout

FACTOR_ATTRS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
VLLM_MODULES_TO_SAVE = ("classifier", "score")
"""The only ``modules_to_save`` vLLM serves in an adapter (``PEFTHelper``)."""
VLLM_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
"""``init_lora_weights`` strings that set only the starting factors (vLLM's ``PEFTHelper`` takes these)."""


def adapter_tensors(layout: LoraLayout, names: Iterable[str]) -> list[tuple[str, str]]:
    """``(name as held, name as PEFT saves it)`` of the active adapter's
    tensors among ``names`` (the source's parameters), in their order.

    Raises:
        ValueError: what ``check_adapter`` raises, and ``modules_to_save``
            on modules vLLM serves no copy of.
    """
    layout.check_adapter()
    (adapter,) = layout.active_adapters()
    problem = config_refusal(_find_peft_config(layout.root, adapter))
    if problem:
        raise ValueError(f"lora: adapter: {problem}. Use lora: merge")
    factor_names = {
        n: saved_name(layout, n, adapter)
        for path, layer in layout.layers
        if adapter in layout.applied_adapters(layer)
        for n in (
            (f"{path}.lora_embedding_A.{adapter}", f"{path}.lora_embedding_B.{adapter}")
            if adapter in layer.lora_embedding_A
            else (f"{path}.lora_A.{adapter}.weight", f"{path}.lora_B.{adapter}.weight")
        )
    }
    copies: dict[str, str] = {}
    for path, wrapper in layout.wrappers:
        if adapter not in getattr(wrapper, "modules_to_save", {}):
            continue
        if path.rpartition(".")[2] not in VLLM_MODULES_TO_SAVE:
            raise ValueError(
                f"lora: adapter: modules_to_save holds {path}, and vLLM serves only {list(VLLM_MODULES_TO_SAVE)} "
                "as trained copies in an adapter. Use lora: merge"
            )
        prefix = f"{path}.modules_to_save.{adapter}."
        copies.update({n: saved_name(layout, n, adapter) for n in names if n.startswith(prefix)})
    wanted = {**factor_names, **copies}
    return [(n, wanted[n]) for n in names if n in wanted]

def config_refusal(config: Any) -> str | None:
    """What in a ``LoraConfig`` an adapter served by vLLM cannot carry (its
    ``PEFTHelper`` refuses it at load, after the round), or ``None``."""
    bias = getattr(config, "bias", "none")
    if bias != "none":
        return f"bias={bias!r} trains the base model's biases, which the adapter does not carry (vLLM serves bias='none' only)"
    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in VLLM_INITS:
        return (
            f"init_lora_weights={init!r} changes the base model's weights (PiSSA, OLoRA, CorDA, LoftQ), "
            "while the server serves the original ones"
        )
    if getattr(config, "alora_invocation_tokens", None):
        return "Activated LoRA (alora_invocation_tokens) is not served by vLLM"
    if getattr(config, "layer_replication", None):
        return "layer_replication is not served by vLLM"
    return None


def saved_name(layout: LoraLayout, name: str, adapter: str) -> str:
    """``name`` as ``save_pretrained`` of the PEFT model writes it (``base_model.model.`` first, no adapter name)."""
    local = name[len(layout.model_prefix) + 1 :] if layout.model_prefix else name
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

def max_rank(layout: LoraLayout) -> int:
    """The largest rank of the active adapter (what vLLM's ``--max-lora-rank`` must cover)."""
    return max((int(layer.r[a]) for _, layer in layout.layers for a in layout.applied_adapters(layer)), default=0)

def adapter_config(layout: LoraLayout) -> dict[str, Any]:
    """The active adapter's ``adapter_config.json``: PEFT's config, plus
    per-module ``rank_pattern`` / ``alpha_pattern`` taken from the live
    layers, so a server computes the scaling the trainer's layers apply
    (``set_scale`` included) whatever PEFT's pattern rules made of the
    config."""
    (adapter,) = layout.active_adapters()
    config = _find_peft_config(layout.root, adapter)
    data = json.loads(json.dumps(config.to_dict(), default=_json_value))
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    rslora = bool(data.get("use_rslora", False))
    for path, layer in layout.layers:
        if adapter not in layout.applied_adapters(layer):
            continue
        module = saved_name(layout, path, adapter).removeprefix(PEFT_PREFIX)
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
