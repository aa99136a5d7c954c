"""The weight-transfer system: vLLM's trainer/worker API, implemented without vLLM.

Public names match ``vllm.distributed.weight_transfer`` so code written for
vLLM's API runs unchanged, and the wire dicts match vLLM's so a vLLM server
(with our plugin) is a drop-in receiver.
"""

from wt_callbacks.transfer.base import (
    ParamMeta,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferConfig,
    WeightTransferEngine,
    WeightTransferError,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferUpdateInfo,
    WeightTransferUpdatePayload,
    WeightTransferUpdateRequest,
    materialize_full_tensor,
)
from wt_callbacks.transfer.clients import (
    HTTPVLLMWeightSyncClient,
    RayVLLMWeightSyncClient,
    WeightSyncHTTPError,
)
from wt_callbacks.transfer.sources import ModuleSource
from wt_callbacks.transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

__all__ = [
    "HTTPVLLMWeightSyncClient",
    "ModuleSource",
    "ParamMeta",
    "RayVLLMWeightSyncClient",
    "TrainerWeightTransferEngine",
    "VLLMWeightSyncClient",
    "WeightSource",
    "WeightSyncHTTPError",
    "WeightTransferConfig",
    "WeightTransferEngine",
    "WeightTransferEngineFactory",
    "WeightTransferError",
    "WeightTransferInitInfo",
    "WeightTransferInitRequest",
    "WeightTransferTrainerFactory",
    "WeightTransferUpdateInfo",
    "WeightTransferUpdatePayload",
    "WeightTransferUpdateRequest",
    "materialize_full_tensor",
]
