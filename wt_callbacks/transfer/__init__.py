"""The weight-transfer system: vLLM's trainer/worker API, implemented without vLLM.

Public names and module paths match ``vllm.distributed.weight_transfer``
(``base``, ``clients``, ``factory``, ``nccl_engine``, ``ipc_engine``), so code
written for vLLM's API runs after replacing that package prefix with
``wt_callbacks.transfer``; the wire dicts match vLLM's so a vLLM server (with
our plugin) is a drop-in receiver.
"""

from wt_callbacks.transfer.base import (
    ParamMeta,
    Replicate,
    Shard,
    TrainerInitInfo,
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
    "Replicate",
    "Shard",
    "TrainerInitInfo",
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
