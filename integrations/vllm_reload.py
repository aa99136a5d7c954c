"""Rounds through vLLM's layerwise reload that are exact, and never succeed on stale weights.

vLLM 0.32 reloads a model layer by layer (``model_loader/reload/layerwise.py``):
``start`` moves every layer's parameters to meta, the model's own
``load_weights`` buffers what arrives, a layer is processed (its kernels
rebuilt, the result copied into the old storage) once all its elements are
loaded, and ``finish`` restores what was not loaded. Three things go wrong
there, silently, and this module is what the plugin's engine adds around them.
Everything is keyed on what vLLM's own objects declare (shared parameters,
``quant_method`` state, the layerwise counters, the model's ``load_weights``),
never on an architecture:

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
* **Completeness** (``Coverage``, ``check_update``, ``find_incomplete``).
  Before any byte moves, the round's names and shapes run through the
  model's own ``load_weights`` on meta tensors (``trace_load``), recording
  which served parameter and shard each name loads into; a round that would
  leave a checkpoint tensor unloaded, send a name the model drops, or trip a
  loader's check is refused, naming the tensor, with nothing changed on the
  server. What "complete" means is the same trace run once over the served
  checkpoint's safetensors headers. At finish, vLLM's per-layer counters are
  compared with that trace: an incomplete layer gets its previous weights
  back and the round fails naming the first served parameter not updated.

What a failure keeps: every previous weight, for a round refused before
streaming and for one cut mid-stream, since layers completed while an
update streams are processed only once all of its tensors have arrived
(``processing_deferred``); with the trainer's ``all_or_nothing`` off, the
layers a cut round completed were processed and hold the new weights. A
round found incomplete at finish keeps the
previous weights of the layers it did not complete, while the layers it did
complete hold the new ones (push again): by then the update had ended and
its layers were processed. The check before streaming refuses such a round
whenever the served checkpoint is local safetensors, so this is the case of
a checkpoint without them.

All of this reaches into vLLM's reload internals; ``missing_reload_internals``
names what a vLLM version lacks, and the engine refuses to start without them
rather than serve stale weights.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

Meta = tuple[str, torch.dtype, tuple[int, ...]]
Target = tuple[Any, ...]
"""What one loader call writes: (served layer name, parameter attribute, *shard keys)."""

_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
_META = "vllm.model_executor.model_loader.reload.meta"
REQUIRED_INTERNALS = {
    _LAYERWISE: ("_layerwise_process", "get_numel_loaded", "get_layerwise_info", "_place_kernel_tensors", "LOADING_LAYERS"),
    _META: ("SKIP_TENSORS", "SKIP_LOAD_TENSORS", "to_meta_tensor"),
}


def missing_reload_internals() -> list[str]:
    """The vLLM internals this module needs that the installed vLLM lacks (empty: all there)."""
    import importlib

    missing = []
    for module_name, names in REQUIRED_INTERNALS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        missing += [f"{module_name}.{n}" for n in names if not hasattr(module, n)]
    return missing


# --------------------------------------------------------------------------- #
# Tied parameters
# --------------------------------------------------------------------------- #


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

    def partner_processed(self, layer: torch.nn.Module, processed: set[int]) -> bool:
        return any(
            id(other) in processed
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


# --------------------------------------------------------------------------- #
# Fused MoE kernels on CPU
# --------------------------------------------------------------------------- #


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


# --------------------------------------------------------------------------- #
# Parameters layerwise reload leaves live
# --------------------------------------------------------------------------- #


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


# --------------------------------------------------------------------------- #
# Processing deferred to the end of an update
# --------------------------------------------------------------------------- #


@contextmanager
def _layerwise_replaced(**functions: Any) -> Iterator[None]:
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
def processing_deferred() -> Iterator[None]:
    """Layers that complete while an update streams are processed (their new
    weights copied into the served tensors) only once every tensor of the
    update has been received, in the order they completed; if the body
    raises, none is, and every layer still holds its previous weights.

    Layerwise reload processes a layer the moment its last element arrives,
    so a round cut mid-stream would keep the layers it completed new and
    serve a mix. A packed update on CPU holds no memory the worker does not
    hold anyway: a completed layer's buffered tensors are views of the
    receive buffers, which keep a whole round (every chunk has its own,
    since layerwise reload keeps views, and they are kept between rounds).
    Where a layer's received tensors used to be freed once it was processed
    (``packed=False``, or ``transport="nccl"``, whose chunks live in device
    memory) they now stay until the update ends: up to one more copy of the
    model in the wire dtype. What it costs in time is the overlap of
    processing with receiving. A layer loaded again after it completed (a
    name sent twice) is now loaded again, where vLLM dropped the extra load.
    The unit is one ``update_weights``: a round split over several keeps
    what its earlier updates applied.
    """
    from vllm.model_executor.model_loader.reload import layerwise

    real_process = layerwise._layerwise_process
    completed: dict[int, tuple[torch.nn.Module, Any]] = {}

    def defer(layer: torch.nn.Module, info: Any) -> None:
        completed.setdefault(id(layer), (layer, info))

    with _layerwise_replaced(_layerwise_process=defer):
        yield
    for layer, info in completed.values():
        real_process(layer, info)
        layerwise.LOADING_LAYERS.discard(layer)


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


# --------------------------------------------------------------------------- #
# Tracing a round on meta tensors
# --------------------------------------------------------------------------- #


@dataclass
class LoadTrace:
    targets: dict[str, set[Target]]
    """Sent name -> what its loader calls wrote."""
    counts: dict[int, int]
    """Layer id -> elements loaded, in vLLM's own count."""
    error: str | None = None
    failed_name: str | None = None


def _shard_key(args: Any) -> tuple[Any, ...]:
    """Which part of a parameter a loader call writes: its bound scalar
    arguments other than the tensors (``loaded_shard_id`` of QKV and merged
    linears, ``shard_id``/``expert_id`` of fused MoE, ...)."""
    return tuple(
        (k, v) for k, v in args.arguments.items()
        if k not in ("self", "param", "loaded_weight") and isinstance(v, (str, int, tuple)) and not isinstance(v, bool)
    )  # fmt: skip


def trace_load(model: torch.nn.Module, metas: list[Meta]) -> LoadTrace:
    """``model.load_weights`` over meta tensors of ``metas``, with layerwise
    reload initialized and nothing loaded yet: layers that complete are
    counted, not processed, and afterwards every layer's reload state is as
    it was."""
    from vllm.model_executor.model_loader.reload import layerwise

    trace = LoadTrace({}, {})
    current: list[str | None] = [None]

    def record_uncounted(param: torch.Tensor, *_: Any, **__: Any) -> None:
        trace.targets.setdefault(current[0], set()).add(params.get(id(param), ("?", "?")))

    live = LiveParameters(model)
    live.to_meta(record_uncounted)  # loaded straight into the served tensor otherwise
    params = {
        id(p): (layer_name, attr)
        for layer_name, layer in model.named_modules()
        for attr, p in layer._parameters.items()
        if p is not None
    }
    real_count = layerwise.get_numel_loaded

    def count_completed(layer: torch.nn.Module, info: Any) -> None:
        trace.counts[id(layer)] = int(info.load_numel)

    def record(loader: Any, args: Any) -> tuple[int, Any]:
        numel, ret = real_count(loader, args)
        layer_name, attr = params.get(id(args.arguments.get("param")), ("?", "?"))
        trace.targets.setdefault(current[0], set()).add((layer_name, attr, *_shard_key(args)))
        return numel, ret

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, dtype, shape in metas:
            current[0] = name
            yield name, torch.empty(shape, dtype=dtype, device="meta")
        current[0] = None

    try:
        with _layerwise_replaced(_layerwise_process=count_completed, get_numel_loaded=record):
            model.load_weights(tensors())
    except Exception as e:  # noqa: BLE001 - the refusal names it
        trace.error, trace.failed_name = f"{type(e).__name__}: {e}".rstrip(": "), current[0]
    finally:
        live.put_back()
        for layer in model.modules():
            info = layerwise.get_layerwise_info(layer)
            if info.can_load():
                if info.load_numel > 0 and id(layer) not in trace.counts:
                    trace.counts[id(layer)] = int(info.load_numel)
                info.loaded_weights.clear()
                info.load_numel = 0
        layerwise.LOADING_LAYERS.clear()
    return trace


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def checkpoint_metas(model_dir: str) -> list[Meta] | None:
    """Names, dtypes and shapes of the served checkpoint, from its
    safetensors headers (8 bytes and a JSON header per file); ``None`` when
    it is not a local safetensors checkpoint."""
    directory = Path(model_dir)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        return None
    out = []
    for file in files:
        with open(file, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        header.pop("__metadata__", None)
        for name, entry in header.items():
            dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                return None
            out.append((name, dtype, tuple(entry["shape"])))
    return out


class Coverage:
    """What a complete update loads: the served checkpoint, traced once."""

    def __init__(self, model: torch.nn.Module, metas: list[Meta]) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload, layerwise

        initialize_layerwise_reload(model)
        try:
            trace = trace_load(model, metas)
        finally:  # undo the reload without processing anything: the kernels stay as loaded
            for layer in model.modules():
                info = layerwise.get_layerwise_info(layer)
                if info.can_load():
                    layerwise._place_kernel_tensors(layer, info)
                    info.reset()
            if hasattr(model, "_original_do_torchao_reload"):
                model._do_torchao_reload = model._original_do_torchao_reload
        if trace.error:
            raise RuntimeError(f"tracing the served checkpoint failed at {trace.failed_name!r}: {trace.error}")
        self.needed = {name: targets for name, targets in trace.targets.items() if targets}
        self.counts = trace.counts
        self.shapes = {name: shape for name, _, shape in metas}


# --------------------------------------------------------------------------- #
# The checks
# --------------------------------------------------------------------------- #


@dataclass
class Incomplete:
    """A served layer a round did not fully update."""

    layer_name: str
    param: str
    loaded: int
    expected: int
    shards: list[str] = field(default_factory=list)

    def message(self) -> str:
        served = f"{self.layer_name}.{self.param}"
        if self.loaded == 0:
            return f"served parameter {served!r} was not updated by this round"
        shards = f"; shards loaded: {', '.join(self.shards)}" if self.shards else ""
        return (
            f"served parameter {served!r} was only partly updated by this round "
            f"({self.loaded} of {self.expected} elements of {self.layer_name}{shards})"
        )


def _has_parameters(layer: torch.nn.Module) -> bool:
    return any(p is not None for p in layer._parameters.values())


def _declared_numel(layer: torch.nn.Module, info: Any) -> int:
    """Without a checkpoint trace: vLLM's count less the vocabulary padding
    ``VocabParallelEmbedding`` declares (its loader zero-fills those rows
    uncounted)."""
    total = int(info.load_numel_total or 0)
    indices, rows = getattr(layer, "shard_indices", None), getattr(layer, "num_embeddings_per_partition", 0)
    if indices is None or not rows:
        return total
    for p in layer._parameters.values():
        if p is not None and getattr(p, "output_dim", None) is not None and p.numel():
            total -= p.numel() - p.numel() // rows * indices.num_org_elements
    return total


class ReloadGuard:
    """Everything a round needs around vLLM's layerwise reload (see the module docstring).

    The engine calls ``start`` after ``initialize_layerwise_reload``,
    ``refusal`` before receiving, ``keep_incomplete`` before
    ``finalize_layerwise_reload`` and ``end`` after it; ``abandon`` after a
    failed receive has finalized.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, model_dir: str) -> None:
        missing = missing_reload_internals()
        if missing:
            import vllm

            raise RuntimeError(
                f"wt_callbacks' torch_dist engine cannot guard weight updates on vLLM {vllm.__version__}: "
                f"its reload internals {missing} are gone. Use the vLLM version wt_callbacks supports (0.32)"
            )
        self.model = model
        self.tied = TiedParameters(model)
        self.moe = MoeKernelRebuild(model, device)
        metas = checkpoint_metas(model_dir)
        self.coverage = Coverage(model, metas) if metas else None
        self.round_open = False
        self._live: LiveParameters | None = None
        self._accepted: set[tuple[Any, ...]] = set()
        logger.info(
            "torch_dist engine: tied parameters %s, %d MoE layers rebuilt per round on CPU, completeness "
            "%s", self.tied.describe(), len(self.moe.layers),
            f"checked against {len(metas)} checkpoint tensors" if self.coverage else
            "checked per layer only (the served checkpoint is not local safetensors)",
        )  # fmt: skip

    def start(self) -> None:
        self._live = LiveParameters(self.model)
        self._live.save()
        self.moe.start()
        self.round_open = True

    def refusal(self, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]) -> str | None:
        """Why a round announcing these tensors must be refused before any byte
        moves, or ``None``. A round announcing what an accepted one announced
        is accepted without tracing again: loaders do not look at values."""
        key = (tuple(names), tuple(dtypes), tuple(map(tuple, shapes)))
        if key in self._accepted:
            return None
        metas = [(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes)]
        reason = self._refusal(metas)
        if reason is None:
            self._accepted.add(key)
        return reason

    def _refusal(self, metas: list[Meta]) -> str | None:
        trace = trace_load(self.model, metas)
        if trace.error and "meta" in trace.error:
            # A loader that reads values (quantization scales) cannot run on
            # meta tensors; the check at finish still guards the round.
            logger.warning("cannot trace this round's load on meta tensors (%s); checking at finish only", trace.error)
            return None
        if trace.error:
            return f"the served model's loader rejects {trace.failed_name!r}: {trace.error}"
        dropped = [n for n, _, _ in metas if not trace.targets.get(n) and not self._tied_name(n)]
        if dropped:
            more = f" (and {len(dropped) - 1} more)" if len(dropped) > 1 else ""
            return f"the served model has no parameter for {dropped[0]!r}{more}: vLLM would drop it silently"
        if self.coverage is None:
            return None
        for name, _, shape in metas:
            # vLLM's QKV/merged loaders narrow along the TP dimension before
            # copying: a tensor longer there than the served one is truncated.
            want = self.coverage.shapes.get(name)
            if want is not None and tuple(want) != tuple(shape):
                return f"{name!r} has shape {list(shape)}; the served checkpoint's is {list(want)}"
        sent = set().union(*trace.targets.values()) if trace.targets else set()
        missing = [(n, t) for n, t in self.coverage.needed.items() if not t <= sent]
        if not missing:
            return None
        name, targets = missing[0]
        served = sorted(
            f"{t[0]}.{t[1]}" + (" (" + ", ".join(f"{k}={v}" for k, v in t[2:]) + ")" if t[2:] else "")
            for t in targets - sent
        )
        more = f" (and {len(missing) - 1} more checkpoint tensors)" if len(missing) > 1 else ""
        return f"this round does not send checkpoint tensor {name!r}{more}, which the served model loads into {served[0]}"

    def _tied_name(self, name: str) -> bool:
        """``name`` belongs to a tied layer, whose weights the model's loader
        skips on purpose (``lm_head.weight`` with tied embeddings)."""
        try:
            return self.tied.is_tied(self.model.get_submodule(name.rpartition(".")[0]))
        except AttributeError:
            return False

    def keep_incomplete(self) -> tuple[list[Incomplete], set[int]]:
        """Before finalize: the layers the round left incomplete (in model
        order), made to keep their previous weights, and the ids of the layers
        the round processed."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        processed: set[int] = set()
        rows = []
        for name, layer in self.model.named_modules():
            info = get_layerwise_info(layer)
            if not info.can_load() or info.load_numel > 0:
                processed.add(id(layer))
            if info.can_load() and _has_parameters(layer):
                rows.append((name, layer, info))
        incomplete = []
        for name, layer, info in rows:
            expected = self.coverage.counts.get(id(layer), 0) if self.coverage else _declared_numel(layer, info)
            if info.load_numel >= expected:
                continue
            if info.load_numel == 0 and self.tied.is_tied(layer) and self.tied.partner_processed(layer, processed):
                continue
            incomplete.append(self._describe(name, layer, info, expected))
            # Nothing buffered: finalize puts the old kernel tensors back unprocessed.
            info.loaded_weights.clear()
            info.load_numel = 0
            processed.discard(id(layer))
            if self._live is not None:
                self._live.restore({id(layer)})
        return incomplete, processed

    @staticmethod
    def _describe(name: str, layer: torch.nn.Module, info: Any, expected: int) -> Incomplete:
        per_param: dict[str, int] = {}
        shards: dict[str, set[str]] = {}
        for attr, args in info.loaded_weights:
            w = args.arguments.get("loaded_weight")
            per_param[attr] = per_param.get(attr, 0) + (w.numel() if isinstance(w, torch.Tensor) else 0)
            key = _shard_key(args)
            if key:
                shards.setdefault(attr, set()).add(",".join(f"{k}={v}" for k, v in key))
        attrs = [a for a, p in layer._parameters.items() if p is not None]
        worst = min(attrs, key=lambda a: per_param.get(a, 0) / max(1, layer._parameters[a].numel()))
        return Incomplete(name, worst, int(info.load_numel), int(expected), sorted(shards.get(worst, ())))

    def processed_layers(self) -> set[int]:
        """Ids of the layers the round processed so far (before a failed
        receive finalizes)."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        return {id(m) for m in self.model.modules() if not get_layerwise_info(m).can_load()}

    def end(self, processed: set[int]) -> list[str]:
        """After finalize: MoE kernels and ties right again. Returns the tied
        layers processed again."""
        self.moe.finish()
        self.round_open = False
        return self.tied.restore(processed)

    def abandon(self, processed: set[int]) -> None:
        """After a failed receive was finalized: layers it did not process
        get their live parameters' previous values back."""
        if self._live is not None:
            self._live.restore({id(m) for m in self.model.modules()} - processed)
        self.end(processed)
