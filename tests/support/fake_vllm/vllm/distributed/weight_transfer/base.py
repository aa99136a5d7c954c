"""Fake of vllm.distributed.weight_transfer.base (see ../../../README.md)."""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: Any
    shape: tuple


class WeightSource(ABC):
    @abstractmethod
    def metadata(self): ...

    @abstractmethod
    def __iter__(self): ...


@dataclass
class TrainerInitInfo:
    backend: ClassVar[str]
    rank: int = field(kw_only=True)


class RecordingTrainerEngine:
    """Records trainer_init's arguments; send_weights drives the client like vLLM's
    engines (start, update with the metadata, finish without a version)."""

    created: ClassVar[list] = []

    def __init__(self, init_info, client, source):
        self.init_info, self.client, self.source = init_info, client, source
        self.sent: list = []
        self.shut_down = False

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        engine = cls(init_info, client, source)
        cls.created.append(engine)
        if init_info.rank == 0:
            client.init_weight_transfer_engine({"fake": True})
        return engine

    def send_weights(self):
        meta = self.source.metadata()
        if self.init_info.rank == 0:
            self.client.start_weight_update()
            self.client.update_weights({"names": [m.name for m in meta]})
        self.sent = [(name, tensor.dtype) for name, tensor in self.source]
        if self.init_info.rank == 0:
            self.client.finish_weight_update()

    def shutdown(self):
        self.shut_down = True
