"""Fake of vllm.distributed.weight_transfer.nccl_engine (see ../../../README.md)."""

from dataclasses import dataclass
from typing import ClassVar

from vllm.distributed.weight_transfer.base import RecordingTrainerEngine, TrainerInitInfo


@dataclass
class NCCLTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "nccl"
    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = 1024**3
    packed_num_buffers: int = 2


class NCCLTrainerWeightTransferEngine(RecordingTrainerEngine):
    created: ClassVar[list] = []
