"""Fake of vllm.distributed.weight_transfer.ipc_engine (see ../../../README.md)."""

from dataclasses import dataclass
from typing import ClassVar

from vllm.distributed.weight_transfer.base import RecordingTrainerEngine, TrainerInitInfo


@dataclass
class IPCTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "ipc"
    packed: bool = False
    packed_buffer_size_bytes: int = 1024**3


class IPCTrainerWeightTransferEngine(RecordingTrainerEngine):
    created: ClassVar[list] = []
