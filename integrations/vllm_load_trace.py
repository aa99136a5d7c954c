"""A round traced on meta tensors through the served model's own ``load_weights``.

Before any byte moves, the round's names and shapes run through the model's
loader on meta tensors (``trace_load``), with layerwise reload initialized
and its processing swapped for counting: which served parameter and shard
each name loads into, how many elements each layer would receive, and any
loader check a name trips. What "complete" means (``Coverage``) is the same
trace run once over the served checkpoint's safetensors headers
(``checkpoint_metas``). ``vllm_reload.ReloadGuard`` compares the two.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wt_callbacks.integrations.vllm_layerwise import layerwise_replaced, reload_undone
from wt_callbacks.integrations.vllm_reload_state import LiveParameters

Meta = tuple[str, torch.dtype, tuple[int, ...]]
Target = tuple[Any, ...]
"""What one loader call writes: (served layer name, parameter attribute, *shard keys)."""


@dataclass
class LoadTrace:
    targets: dict[str, set[Target]]
    """Sent name -> what its loader calls wrote."""
    counts: dict[int, int]
    """Layer id -> elements loaded, in vLLM's own count."""
    error: str | None = None
    failed_name: str | None = None


def shard_key(args: Any) -> tuple[Any, ...]:
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
        trace.targets.setdefault(current[0], set()).add((layer_name, attr, *shard_key(args)))
        return numel, ret

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, dtype, shape in metas:
            current[0] = name
            yield name, torch.empty(shape, dtype=dtype, device="meta")
        current[0] = None

    try:
        with layerwise_replaced(_layerwise_process=count_completed, get_numel_loaded=record):
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
        with reload_undone(model):  # the kernels stay as loaded
            trace = trace_load(model, metas)
        if trace.error:
            raise RuntimeError(f"tracing the served checkpoint failed at {trace.failed_name!r}: {trace.error}")
        self.needed = {name: targets for name, targets in trace.targets.items() if targets}
        self.counts = trace.counts
        self.shapes = {name: shape for name, _, shape in metas}
