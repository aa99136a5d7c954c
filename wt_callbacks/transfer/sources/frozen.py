"""Which sent tensors a round may leave as the servers hold them: frozen ones, in whole serving units.

A PEFT model trains its adapters; the base weights no adapter targets
never change. Once the servers hold them (a round of the connection
was acknowledged), re-sending them moves bytes for nothing: at a 0.5B
shape with LoRA on every linear layer, the embedding alone is 28% of a
merged round. ``keepable`` names the sent tensors a round may keep instead
(``ModuleSource.keep``, ``SyncConfig.send_frozen``).

A tensor is kept only when every parameter it is made from does not train
(``requires_grad`` is false), is not a buffer (buffers change without an
optimizer), and is not the base of a LoRA layer (an adapter may be merged
into it, in place or not). That is not enough: vLLM
loads some checkpoint tensors into one layer together (``q_proj``,
``k_proj`` and ``v_proj`` into ``qkv_proj``; ``gate_proj`` and ``up_proj``
into ``gate_up_proj``; every expert into one fused MoE layer), and a layer
either receives all of its tensors in a round or keeps its previous weights
whole: its previous tensors cannot be fed back through its loader. With
LoRA on ``q_proj`` and ``v_proj`` (PEFT's default for Llama), ``k_proj`` is
frozen but must be sent. The trainer does not know the server's fusions, so
it keeps what no fusion reaches:

* a standalone module's tensors (embeddings, the output head, norms),
  which every vLLM model loads into a layer of their own, when all of them
  are keepable (a LayerNorm whose bias trains sends its weight too);
* any other module's only when every such tensor of its *unit* is
  keepable: the unit is the module's parent (``self_attn``, ``mlp``),
  climbing over list indices (``mlp.experts.3`` -> ``mlp``), since fused
  layers join siblings, and experts across their list.

The server checks it anyway (a kept and a sent tensor loaded into one
layer refuse the round before any byte moves, naming both), so a model
this rule misjudges fails loudly, naming ``send_frozen: every_round``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from wt_callbacks.naming import checkpoint_name
from wt_callbacks.transfer.sources.checkpoint_format import ConversionGroup


def _ancestors(path: str) -> Iterable[str]:
    """``path`` and every module path above it, the root (``""``) last."""
    while path:
        yield path
        path = path.rpartition(".")[0]
    yield ""


def _unit(module_path: str) -> str:
    """The module whose children a server may load into one layer."""
    unit = module_path.rpartition(".")[0]
    while unit.rpartition(".")[2].isdigit():
        unit = unit.rpartition(".")[0].rpartition(".")[0]
    return unit


def _output_embeddings(root: torch.nn.Module) -> set[int]:
    """ids of a transformers model's output head and the modules a wrapper holds it in."""
    found: set[int] = set()
    owner = next((m for m in root.modules() if callable(getattr(m, "get_output_embeddings", None))), None)
    module = owner.get_output_embeddings() if owner is not None else None
    while module is not None:
        found.add(id(module))
        module = getattr(module, "base_layer", None) or getattr(module, "original_module", None)
    return found


def keepable(
    root: torch.nn.Module,
    *,
    held: Mapping[str, bool],
    targeted: Iterable[str],
    groups: Iterable[ConversionGroup],
    module_base: Callable[[str], str | None],
) -> frozenset[str]:
    """The outputs of ``groups`` a round may keep (see the module docstring).

    Args:
        root: the sent module.
        held: every input name (checkpoint naming, a PEFT model's base
            names) -> whether it is a parameter that does not train.
        targeted: input names an adapter may have changed (LoRA layers' bases).
        groups: the checkpoint-format groups of the sent tensors.
        module_base: a module's path as the sent names give it (a PEFT
            model's base path), ``None`` for a module an adapter owns.
    """
    modules: dict[str, torch.nn.Module] = {}
    for raw, module in root.named_modules():
        path = module_base(checkpoint_name(raw))
        if path is not None:
            modules[path] = module  # the innermost module at a path: PEFT's base_layer
    heads = _output_embeddings(root)
    targeted = set(targeted)

    def standalone(path: str) -> bool:
        module = modules.get(path)
        return module is not None and (
            isinstance(module, torch.nn.Embedding) or "norm" in type(module).__name__.lower() or id(module) in heads
        )

    frozen = {name: still and name not in targeted and name.rpartition(".")[0] in modules for name, still in held.items()}
    # A tensor that is not keepable blocks its own module, and every module
    # above one that is not standalone.
    blocked: set[str] = set()
    for name, ok in frozen.items():
        path = name.rpartition(".")[0]
        if not ok:
            blocked.update([path] if standalone(path) else _ancestors(path))

    def kept(name: str) -> bool:
        path = name.rpartition(".")[0]
        return frozen.get(name, False) and path not in blocked and (standalone(path) or _unit(path) not in blocked)

    return frozenset(o.name for g in groups if all(kept(i) for i in g.inputs) for o in g.outputs)
