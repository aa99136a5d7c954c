"""Registries that turn a backend name into an engine class.

Two registries, as in vLLM: the trainer never builds a worker engine and the
worker never builds a trainer engine, so keeping them apart keeps each
process's import graph small. Both load lazily: registering by module path
imports nothing until the backend is used.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from wt_callbacks.transfer.base import (
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferConfig,
    WeightTransferEngine,
)

logger = logging.getLogger(__name__)

TEngine = TypeVar("TEngine")


class _Registry:
    """Name -> lazy class loader; shared by both factories."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.loaders: dict[str, Callable[[], type]] = {}

    def register(self, name: str, module_path_or_cls: str | type, class_name: str | None) -> None:
        if name in self.loaders:
            raise ValueError(f"{self.kind} '{name}' is already registered.")
        if isinstance(module_path_or_cls, str):
            if class_name is None:
                raise ValueError("class_name is required when registering with module path")
            module_path = module_path_or_cls

            def loader() -> type:
                return getattr(importlib.import_module(module_path), class_name)

            self.loaders[name] = loader
        else:
            engine_cls = module_path_or_cls
            self.loaders[name] = lambda: engine_cls

    def load(self, name: str) -> type:
        if name not in self.loaders:
            raise ValueError(
                f"Invalid weight transfer backend: {name!r}. "
                f"Available {self.kind}s: {sorted(self.loaders)}"
            )
        return self.loaders[name]()


class WeightTransferEngineFactory:
    """Worker-side registry: backend name -> ``WeightTransferEngine`` class."""

    _registry = _Registry("engine")

    @classmethod
    def register_engine(
        cls,
        name: str,
        module_path_or_cls: str | type[WeightTransferEngine],
        class_name: str | None = None,
    ) -> None:
        """Register lazily (``name, "pkg.module", "ClassName"``) or directly
        (``name, EngineClass``). A name registered twice raises ``ValueError``."""
        cls._registry.register(name, module_path_or_cls, class_name)

    @classmethod
    def available(cls) -> list[str]:
        return sorted(cls._registry.loaders)

    @classmethod
    def create_engine(
        cls,
        config: WeightTransferConfig,
        vllm_config: Any,
        device: torch.device,
        model: torch.nn.Module,
    ) -> WeightTransferEngine:
        """Instantiate the engine of ``config.backend``; ``ValueError`` listing
        the registered backends if it is unknown."""
        engine_cls = cls._registry.load(config.backend)
        logger.info("Creating weight transfer engine: %s", engine_cls.__name__)
        return engine_cls(config, vllm_config, device, model)


class WeightTransferTrainerFactory:
    """Trainer-side registry: backend name -> ``TrainerWeightTransferEngine``."""

    _registry = _Registry("trainer engine")

    @classmethod
    def register_engine(
        cls,
        name: str,
        module_path_or_cls: str | type[TrainerWeightTransferEngine],
        class_name: str | None = None,
    ) -> None:
        """Same conventions as ``WeightTransferEngineFactory.register_engine``."""
        cls._registry.register(name, module_path_or_cls, class_name)

    @classmethod
    def available(cls) -> list[str]:
        return sorted(cls._registry.loaders)

    @classmethod
    def engine_class(cls, backend: str) -> type[TrainerWeightTransferEngine]:
        """The trainer engine class of ``backend`` (``ValueError`` if unknown)."""
        return cls._registry.load(backend)

    @classmethod
    def trainer_init(
        cls,
        backend: str,
        config: Any | Mapping[str, Any],
        init_info: Any | Mapping[str, Any],
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
    ) -> TrainerWeightTransferEngine:
        """Build and rendezvous a ready-to-send trainer engine.

        Called on every trainer rank; the sender is trainer rank 0, read from
        ``init_info["rank"]``. ``config`` and ``init_info`` may be the
        backend's dataclasses or plain dicts (from a YAML file), validated the
        same way.

        Raises:
            ValueError: unknown backend (the message lists the registered
                ones), or a bad/missing/unknown key in ``config``/``init_info``.
        """
        engine_cls = cls.engine_class(backend)
        logger.info("Creating weight transfer trainer engine: %s", engine_cls.__name__)
        return engine_cls.trainer_init(config, init_info, client=client, source=source)


# Built-in backends. Registered by module path: nothing is imported until used.
WeightTransferEngineFactory.register_engine(
    "torch_dist", "wt_callbacks.transfer.backends.torch_dist", "TorchDistWeightTransferEngine"
)
WeightTransferTrainerFactory.register_engine(
    "torch_dist", "wt_callbacks.transfer.backends.torch_dist", "TorchDistTrainerWeightTransferEngine"
)
# Stock vLLM's own wire (CUDA; needs vllm importable in the trainer).
WeightTransferTrainerFactory.register_engine(
    "nccl", "wt_callbacks.transfer.backends.vllm_native", "NCCLTrainerWeightTransferEngine"
)
WeightTransferTrainerFactory.register_engine(
    "ipc", "wt_callbacks.transfer.backends.vllm_native", "IPCTrainerWeightTransferEngine"
)
