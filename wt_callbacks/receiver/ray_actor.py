"""The receiver in a Ray actor, with the weight methods of vLLM's ``LLM``."""

from collections.abc import Mapping
from typing import Any

import torch

from wt_callbacks.receiver.cli import load_model
from wt_callbacks.receiver.core import ReceiverCore
from wt_callbacks.transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest


class RayReceiver:
    """A receiver hosted in a Ray actor, with vLLM ``LLM``'s weight methods.

    Use as ``ray.remote(RayReceiver).remote(model_dir_or_module)``; drive it
    with ``RayVLLMWeightSyncClient``. Requests may be the request dataclasses
    or dicts of the form ``{"init_info": ...}`` / ``{"update_info": ...}``,
    as vLLM's ``LLM`` accepts.
    """

    def __init__(self, model_dir_or_module: str | torch.nn.Module, backend: str = "torch_dist", dtype: str | None = None) -> None:
        if isinstance(model_dir_or_module, torch.nn.Module):
            if dtype is not None:  # it would be ignored: a module is served as it is given
                raise ValueError(
                    f"dtype={dtype!r} applies to a model directory; pass the module in the dtype to serve "
                    "(module.to(dtype)) and no dtype"
                )
            model = model_dir_or_module.eval()
        else:
            model = load_model(model=model_dir_or_module, dtype=dtype)
        self.core = ReceiverCore(model, backend=backend)

    def init_weight_transfer_engine(self, request: WeightTransferInitRequest | Mapping[str, Any]) -> None:
        self.core.init_weight_transfer_engine(_payload(request, WeightTransferInitRequest, "init_info"))

    def start_weight_update(self) -> None:
        self.core.start_weight_update()

    def update_weights(self, request: WeightTransferUpdateRequest | Mapping[str, Any]) -> None:
        self.core.update_weights(_payload(request, WeightTransferUpdateRequest, "update_info"))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.core.finish_weight_update(weight_version)

    def update_weight_version(self, new_version: str) -> None:
        self.core.update_weight_version(new_version)

    def get_weight_version(self) -> str:
        return self.core.weight_version

    def get_world_size(self) -> int:
        return 1

    def weight_info(self) -> dict[str, Any]:
        return self.core.weight_info()

    def weight_checksums(self) -> dict[str, Any]:
        return self.core.weight_checksums()

    def shutdown_weight_transfer_engine(self) -> None:
        self.core.shutdown_weight_transfer_engine()


def _payload(request: Any, request_cls: type, key: str) -> Any:
    """What ``request`` carries: a ``request_cls`` or the dict ``{key: ...}``
    vLLM's ``LLM`` takes in its place; anything else (the bare payload,
    most likely) is refused naming the form to use."""
    if isinstance(request, request_cls):
        return getattr(request, key)
    if isinstance(request, Mapping) and list(request) == [key]:
        return request[key]
    got = f"a dict with keys {list(request)[:5]}" if isinstance(request, Mapping) else f"a {type(request).__name__}"
    raise ValueError(f"request must be a {request_cls.__name__} or {{{key!r}: ...}}, as vLLM's LLM takes; got {got}")
