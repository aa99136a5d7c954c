"""A saved LoRA adapter applied to a copy of its base model, without PEFT (the reference receiver).

What vLLM does with an adapter it loads, for a server that is a plain torch
model: each ``A`` / ``B`` pair is added to its module's weight by PEFT's merge
rule (``merge.Merge``), with the scaling PEFT derives from the adapter's
config (``lora_alpha / r``, ``/ sqrt(r)`` with rsLoRA, ``rank_pattern`` /
``alpha_pattern`` matched as PEFT and vLLM match them). An embedding LoRA on
a model that ties its output head to the embedding changes the lookup only,
as in PEFT's forward and vLLM: the copy's head gets a weight of its own
first.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from wt_callbacks.lora.layout import PEFT_PREFIX
from wt_callbacks.lora.merge import LINEAR, TRANSPOSED, Merge, Term

_FACTORS = {"lora_A": ("A", LINEAR), "lora_B": ("B", LINEAR), "lora_embedding_A": ("A", TRANSPOSED), "lora_embedding_B": ("B", TRANSPOSED)}


def rank_and_scaling(config: Mapping[str, Any], module: str) -> tuple[int, float]:
    """PEFT's rank and scaling of ``module`` (its name without ``base_model.model.``) under ``config``."""

    def pattern(key: str, default: Any) -> Any:
        for pat, value in (config.get(key) or {}).items():
            if re.match(rf"(.*\.)?({pat})$", module):
                return value
        return default

    r = int(pattern("rank_pattern", config["r"]))
    alpha = float(pattern("alpha_pattern", config["lora_alpha"]))
    return r, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def adapted_copy(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> torch.nn.Module:
    """A copy of ``model`` (the base checkpoint's module) serving the adapter.

    Raises:
        ValueError: a tensor that is no LoRA factor of a module of ``model``
            (the adapter was trained on another base, or a kind of adapter
            this receiver does not apply).
    """
    pairs: dict[str, dict[str, str]] = {}
    kinds: dict[str, str] = {}
    for name in tensors:
        local = name.removeprefix(PEFT_PREFIX)
        parts = local.split(".")
        key = next((i for i, p in enumerate(parts) if p in _FACTORS), None)
        if key is None or parts[key + 1 :] != (["weight"] if parts[key] in ("lora_A", "lora_B") else []):
            raise ValueError(f"adapter tensor {name!r} is not a LoRA factor this receiver applies")
        module = ".".join(parts[:key])
        which, kind = _FACTORS[parts[key]]
        pairs.setdefault(module, {})[which] = name
        kinds[module] = kind
    adapted = copy.deepcopy(model)
    untie_embeddings(adapted, [m for m, k in kinds.items() if k == TRANSPOSED])
    with torch.no_grad():
        for module, factors in pairs.items():
            if set(factors) != {"A", "B"}:
                raise ValueError(f"adapter module {module!r} has {sorted(factors)} but needs A and B")
            try:
                weight = adapted.get_submodule(module).weight
            except AttributeError as e:
                raise ValueError(f"adapter module {module!r} is not a module of {type(model).__name__} with a weight") from e
            _, scaling = rank_and_scaling(config, module)
            term = Term(SimpleNamespace(scaling={"a": scaling}), "a", factors["A"], factors["B"])
            merged = Merge(module, kinds[module], (term,)).full(weight, tensors)
            weight.copy_(merged.to(weight.dtype))
    return adapted


def untie_embeddings(model: torch.nn.Module, modules: list[str]) -> None:
    """Give the output head its own weight when one of ``modules`` is an input
    embedding it shares a weight with: the adapter changes the lookup only."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    if head is None or embed is None or head.weight is not embed.weight:
        return
    if any(model.get_submodule(m) is embed for m in modules):
        head.weight = torch.nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
