"""Served-model state that vLLM's layerwise reload gets wrong, kept right per round.

Everything here is keyed on what vLLM's own objects declare (shared
parameters, ``quant_method`` state, ``SKIP_TENSORS``), never on an
architecture:

* **Tied parameters** (``TiedParameters``). A tied ``lm_head`` gets no weights
  in a round (the loader skips ``lm_head.*`` when embeddings are tied), so
  finish only puts its tensor back and never re-runs its post-load
  processing. The tensor *is* the embedding's, but on CPU that processing is
  where ``UnquantizedEmbeddingMethod`` packs a copy of it
  (``layer.cpu_linear``): logits kept coming from the previous round's copy.
  After finish, every layer sharing a parameter is re-pointed at the group's
  tensor and members the round did not process are processed again.
* **Fused MoE kernels on CPU** (``MoeKernelRebuild``).
  ``UnquantizedFusedMoEMethod`` treats every processing after the first as a
  weight update and skips the CPU expert prepack, so the kernel read
  checkpoint-layout data as prepacked. Unsetting its ``moe_kernel`` for the
  round makes vLLM run its first-load processing again.
* **Live parameters** (``LiveParameters``): the few loadable parameters
  layerwise reload never moves to meta, whose previous values a failed round
  must put back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _storage_key(t: torch.Tensor) -> Any:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, ValueError):
        ptr = 0
    if ptr == 0 or t.numel() == 0:  # CPU Linear kernels keep an empty weight: only identity ties those
        return ("object", id(t))
    return (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


class TiedParameters:
    """Parameters several layers of the served model share (one tensor or one
    memory), found while the model is loaded and not reloading."""

    def __init__(self, model: torch.nn.Module) -> None:
        found: dict[Any, list[tuple[str, torch.nn.Module, str]]] = {}
        for layer_name, layer in model.named_modules():
            for attr, param in layer._parameters.items():
                if param is not None:
                    found.setdefault(_storage_key(param), []).append((layer_name, layer, attr))
        self.groups = [members for members in found.values() if len({id(m[1]) for m in members}) > 1]
        self._layers = {id(layer) for members in self.groups for _, layer, _ in members}

    def describe(self) -> list[list[str]]:
        return [[f"{n}.{a}" for n, _, a in members] for members in self.groups]

    def is_tied(self, layer: torch.nn.Module) -> bool:
        return id(layer) in self._layers

    def partner_in(self, layer: torch.nn.Module, layers: set[int]) -> bool:
        """Whether a layer ``layer`` shares a tensor with is among ``layers`` (ids)."""
        return any(
            id(other) in layers
            for members in self.groups if any(m is layer for _, m, _ in members)
            for _, other, _ in members
        )  # fmt: skip

    def restore(self, processed: set[int]) -> list[str]:
        """After finish: one tensor per group again, and post-load processing
        re-run for members the round did not process (``processed``: ids of
        layers it did). Returns the layers processed again."""
        redone = []
        for members in self.groups:
            loaded = [(layer, attr) for _, layer, attr in members if id(layer) in processed]
            if not loaded:
                continue
            tensor = getattr(*loaded[0])
            for name, layer, attr in members:
                if layer._parameters.get(attr) is not tensor:
                    layer._parameters[attr] = tensor
                if id(layer) in processed:
                    continue
                method = getattr(layer, "quant_method", None)
                if method is not None:
                    method.process_weights_after_loading(layer)
                redone.append(name)
        return redone


class MoeKernelRebuild:
    """Unset ``quant_method.moe_kernel`` for a round on CPU so vLLM runs its
    first-load MoE processing (the expert prepack) again; layers the round did
    not process get theirs back. Not on a GPU: there experts need no prepack
    and CUDA graphs hold the kernels' addresses."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.layers = [
            m for m in model.modules()
            if device.type == "cpu" and getattr(getattr(m, "quant_method", None), "moe_kernel", None) is not None
        ]  # fmt: skip
        self._saved: dict[int, Any] = {}

    def start(self) -> None:
        for layer in self.layers:
            self._saved[id(layer)] = layer.quant_method.moe_kernel
            layer.quant_method.moe_kernel = None

    def finish(self) -> None:
        for layer in self.layers:
            if layer.quant_method.moe_kernel is None:
                layer.quant_method.moe_kernel = self._saved[id(layer)]
        self._saved.clear()


class LiveParameters:
    """Loadable parameters layerwise reload never moves to meta (vLLM's
    ``SKIP_TENSORS``): ``bias``, whose loader it wraps and counts, and the
    ``SKIP_LOAD_TENSORS`` it neither wraps nor counts but the model's loader
    still writes with ``default_weight_loader`` (the router's
    ``e_score_correction_bias`` of DeepSeek-V2/V3 and GLM-4-MoE). Their
    loaders write into the served tensor while the round streams, before the
    layer is complete, so keeping a layer's previous weights needs their
    values saved at start. Built with layerwise reload initialized."""

    def __init__(self, model: torch.nn.Module) -> None:
        from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

        self.entries = [
            (layer, attr, p)
            for layer in model.modules()
            for attr, p in layer._parameters.items()
            if attr in SKIP_TENSORS and p is not None and not p.is_meta
        ]  # fmt: skip
        self._saved: dict[int, torch.Tensor] = {}

    def save(self) -> None:
        self._saved = {id(p): p.detach().clone() for _, _, p in self.entries}

    def restore(self, layer_ids: set[int] | None = None) -> None:
        """Put the saved values back (into the layers ``layer_ids`` only, if given)."""
        with torch.no_grad():
            for layer, _, p in self.entries:
                if (layer_ids is None or id(layer) in layer_ids) and id(p) in self._saved:
                    p.copy_(self._saved[id(p)])

    def to_meta(self, record_uncounted: Callable[..., None]) -> None:
        """Meta stand-ins for a trace. Those of uncounted tensors get
        ``record_uncounted`` as their loader: no wrapped loader reports them."""
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, to_meta_tensor

        for layer, attr, p in self.entries:
            meta = to_meta_tensor(p)
            if attr in SKIP_LOAD_TENSORS:
                meta.weight_loader = record_uncounted
            layer._parameters[attr] = meta

    def put_back(self) -> None:
        for layer, attr, p in self.entries:
            layer._parameters[attr] = p
