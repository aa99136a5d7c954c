"""Fake of vllm.distributed.weight_transfer.base (see ../../../README.md).

The ``WeightSource`` contract of the release named by ``vllm.__version__``:
0.32 has an abstract ``metadata()`` method and ``__iter__``; 0.33 has an
abstract ``metadata`` property that a subclass must define as a
``functools.cached_property`` (checked when the subclass is defined, as vLLM
does), ``iter_full`` / ``iter_local`` and ``owned_names``.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from vllm import V033


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: Any
    shape: tuple
    owners: tuple | None = field(default=None, kw_only=True)


class WeightSource032(ABC):
    @abstractmethod
    def metadata(self): ...

    @abstractmethod
    def __iter__(self): ...


class WeightSource033(ABC):
    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        metadata = cls.__dict__.get("metadata")
        if metadata is not None and not isinstance(metadata, cached_property):
            raise TypeError(
                f"{cls.__name__}.metadata must be a functools.cached_property: engines read it repeatedly "
                "and it must not change."
            )

    @property
    @abstractmethod
    def metadata(self): ...

    def owned_names(self, rank):
        return [m.name for m in self.metadata if m.owners is None or rank in m.owners]

    def implements_iter_full(self):
        return type(self).iter_full is not WeightSource033.iter_full

    def iter_full(self):
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_full")

    def iter_local(self):
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_local")


WeightSource = WeightSource033 if V033 else WeightSource032


@dataclass
class TrainerInitInfo:
    backend: ClassVar[str]
    rank: int = field(kw_only=True)


class RecordingTrainerEngine:
    """Records trainer_init's arguments; send_weights reads the source and drives
    the client like that release's engines (start, update with the metadata,
    finish without a version). 0.33 refuses a source without iter_full at
    trainer_init and sends an empty update info when the metadata did not change."""

    created: ClassVar[list] = []
    broadcast_fails_after: ClassVar[int | None] = None  # tensors the sender's broadcast sends before it breaks

    def __init__(self, init_info, client, source):
        self.init_info, self.client, self.source = init_info, client, source
        self.sent: list = []
        self.shut_down = False
        self._sent_meta = None

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if V033 and not source.implements_iter_full():
            raise TypeError(f"{type(source).__name__} does not implement iter_full()")
        engine = cls(init_info, client, source)
        cls.created.append(engine)
        if init_info.rank == 0:
            client.init_weight_transfer_engine({"fake": True})
        return engine

    def send_weights(self):
        meta = self.source.metadata if V033 else self.source.metadata()
        if self.init_info.rank == 0:
            self.client.start_weight_update()
            names = [] if V033 and meta == self._sent_meta else [m.name for m in meta]
            self.client.update_weights({"names": names})
        self.sent = []
        for name, tensor in self.source.iter_full() if V033 else self.source:
            if self.init_info.rank == 0 and len(self.sent) == self.broadcast_fails_after:
                raise RuntimeError("NCCL error: remote process exited")
            self.sent.append((name, tensor.dtype))
        if self.init_info.rank == 0:
            self.client.finish_weight_update()
        self._sent_meta = meta

    def shutdown(self):
        self.shut_down = True
