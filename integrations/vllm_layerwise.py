"""What the plugin changes in vLLM's layerwise reload module, and what it needs there.

vLLM 0.32 reloads a model layer by layer (``model_loader/reload/layerwise.py``):
``start`` moves every layer's parameters to meta, the model's own
``load_weights`` buffers what arrives, a layer is processed (its kernels
rebuilt, the result copied into the old storage) once all its elements are
loaded, and ``finish`` restores what was not loaded. The plugin swaps some of
that module's functions for the length of one call (``layerwise_replaced``):
to defer processing to the end of an update (``processing_deferred``), to
trace a round on meta tensors (``vllm_load_trace``), and it filters the
module's per-layer warnings (``failed_load_warnings_quieted``). A trace
outside an update begins a reload and undoes it unprocessed (``reload_undone``).

All of this reaches into vLLM's reload internals; ``missing_reload_internals``
names what a vLLM version lacks, and the engine refuses to start without them
rather than serve stale weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from wt_callbacks.integrations.vllm_internals import missing_names

_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
_META = "vllm.model_executor.model_loader.reload.meta"
REQUIRED_INTERNALS = {
    _LAYERWISE: (
        "_layerwise_process", "get_numel_loaded", "get_layerwise_info", "_place_kernel_tensors", "LOADING_LAYERS",
        "_get_original_loader",
    ),  # fmt: skip
    _META: ("SKIP_TENSORS", "SKIP_LOAD_TENSORS", "SKIP_MODULES", "to_meta_tensor", "materialize_meta_tensor"),
    "vllm.model_executor.model_loader.reload.sanitize": ("layer_ref_sentinel",),
}


def missing_reload_internals() -> list[str]:
    """The vLLM internals this module needs that the installed vLLM lacks (empty: all there)."""
    return missing_names(REQUIRED_INTERNALS)


def layerwise_loader(tensor: torch.Tensor) -> Any:
    """The weight loader of ``tensor`` without layerwise reload's wrappers
    (``default_weight_loader`` where it declares none)."""
    from vllm.model_executor.model_loader.reload import layerwise

    return layerwise._get_original_loader(tensor)


def counted_load(loader: Any, *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """``loader(*args, **kwargs)``, and how many elements it loaded in vLLM's
    count (the elements its ``copy_`` calls wrote), which is what a layer's
    completeness is judged by."""
    import inspect

    from vllm.model_executor.model_loader.reload import layerwise

    return layerwise.get_numel_loaded(loader, inspect.signature(loader).bind(*args, **kwargs))


@contextmanager
def layerwise_replaced(**functions: Any) -> Iterator[None]:
    """vLLM's layerwise reload module with ``functions`` in place of its own of
    those names for the body, the originals back however it ends. Nothing in
    vLLM runs concurrently in the worker meanwhile (the engine core waits on
    the RPC that runs the body), so the swap is safe."""
    from vllm.model_executor.model_loader.reload import layerwise

    originals = {name: getattr(layerwise, name) for name in functions}
    for name, function in functions.items():
        setattr(layerwise, name, function)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(layerwise, name, function)


@contextmanager
def processing_deferred(large_last: Callable[[], bool] | None = None) -> Iterator[None]:
    """Layers that complete while an update streams are processed (their new
    weights copied into the served tensors) only once every tensor of the
    update has been received, in the order they completed (the large ones
    last, ``processing_order``, where ``large_last()``, asked once the body
    ended, says so: whether the round came in mapped memory is known only
    then); if the body raises, none is, and every layer still holds its
    previous weights.

    Layerwise reload processes a layer the moment its last element arrives,
    so a round cut mid-stream would keep the layers it completed new and
    serve a mix. A packed update into host memory kept between rounds holds
    no memory the worker does not hold anyway: a completed layer's buffered
    tensors are views of the receive buffers, which keep a whole round
    (every chunk has its own, since layerwise reload keeps views). Where a
    layer's received tensors used to be freed once it was processed
    (``packed=False``; ``transport="nccl"``, whose chunks live in device
    memory; chunks in mapped memory, ``WT_STAGING_MEMORY``, which go back to
    the OS once the layers they fed were processed) they now stay until the
    update ends: up to one more copy of the model in the wire dtype. What it
    costs in time is the overlap of processing with receiving. A layer loaded
    again after it completed (a name sent twice) is now loaded again, where
    vLLM dropped the extra load. The unit is one ``update_weights``: a round
    split over several keeps what its earlier updates applied.
    """
    from vllm.model_executor.model_loader.reload import layerwise

    real_process = layerwise._layerwise_process
    completed: dict[int, tuple[torch.nn.Module, Any]] = {}

    def defer(layer: torch.nn.Module, info: Any) -> None:
        completed.setdefault(id(layer), (layer, info))

    with layerwise_replaced(_layerwise_process=defer):
        yield
    in_order = list(completed.values())
    if large_last is not None and large_last():
        in_order = processing_order(in_order)
    for layer, info in in_order:
        real_process(layer, info)
        layerwise.LOADING_LAYERS.discard(layer)


LARGE_LAYER_SHARE = 20
"""A layer holding more than 1/20 of an update's buffered bytes is large
(``processing_order``): processing it costs about twice its bytes beyond
what the update holds, which would take the worker past 1.1x the round."""


def processing_order(completed: list[tuple[torch.nn.Module, Any]]) -> list[tuple[torch.nn.Module, Any]]:
    """The order in which the layers an update completed are processed at its
    end: as they completed, the large ones (``LARGE_LAYER_SHARE``) last.

    Processing a layer drops its views of the receive buffers, and a chunk
    whose views are all dropped is freed (in mapped memory, given back to
    the OS); the layer's processing takes new memory (its new tensors; on CPU
    the kernels vLLM repacks from them, where an embedding or ``lm_head``
    keeps its weight beside a packed copy). In the order they completed,
    which is the order of the chunks, the layers free the chunks one after
    another while the next ones take theirs. A large layer processed first
    would take its memory beside the whole round: at 296M fp32 the
    embedding is 0.11x the weights, its processing about twice that. Last,
    it comes when the round is mostly gone: the worker's peak stayed at 1.06x
    the round (received in mapped memory). Where the receive buffers are
    kept (the heap), nothing is freed and the order is left as vLLM's: there
    this order measured 1.74-1.77x against 1.65x at 296M (``commit: staged``)."""
    total = sum(_buffered_bytes(info) for _, info in completed)
    return sorted(completed, key=lambda entry: _buffered_bytes(entry[1]) * LARGE_LAYER_SHARE > total)  # stable


def _buffered_bytes(info: Any) -> int:
    """The bytes of the tensors a layer's loads buffered (not the meta
    parameters they were bound to)."""
    return sum(
        value.nbytes
        for _, args in info.loaded_weights
        for value in args.arguments.values()
        if isinstance(value, torch.Tensor) and not value.is_meta
    )


@contextmanager
def failed_load_warnings_quieted() -> Iterator[list[str]]:
    """For the body, vLLM's ``"<Layer>: Failed to load weights"`` warnings are
    kept out of the log and their layer class names collected instead.

    Finalizing puts the previous weights back into every layer a round did
    not load and warns once per such layer: every round for a layer without
    checkpoint tensors (a rotary embedding's cache), and for every layer of
    a cut round, hundreds of lines none of which says why. The plugin says
    what matters once: an abandoned update, or the layers a finished round
    left incomplete (``ReloadGuard.keep_incomplete``).
    """
    from vllm.model_executor.model_loader.reload import layerwise

    names: list[str] = []

    def collect(record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights":
            return True
        names.append(str(record.args[0]) if isinstance(record.args, tuple) and record.args else "?")
        return False

    layerwise.logger.addFilter(collect)
    try:
        yield names
    finally:
        layerwise.logger.removeFilter(collect)


@contextmanager
def reload_undone(model: torch.nn.Module) -> Iterator[None]:
    """Layerwise reload initialized for the body (a trace runs on the model's
    wrapped loaders), then undone without processing anything: every layer
    gets its kernel tensors back as they were, so a model that serves keeps
    its weights (nothing runs it meanwhile: the body runs inside one call
    of the worker, between two steps of the engine)."""
    from vllm.model_executor.model_loader.reload import (
        initialize_layerwise_reload,
        layerwise,
    )

    initialize_layerwise_reload(model)
    try:
        yield
    finally:
        for layer in model.modules():
            info = layerwise.get_layerwise_info(layer)
            if info.can_load():
                layerwise._place_kernel_tensors(layer, info)
                info.reset()
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload
