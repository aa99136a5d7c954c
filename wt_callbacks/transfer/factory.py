"""Registries that turn a backend name into an engine class.

Two registries, as in vLLM: the trainer never builds a worker engine and the
worker never builds a trainer engine, so keeping them apart keeps each
process's import graph small. Both load lazily: registering by module path
imports nothing until the backend is used.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, overload

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


class _Registry(dict[str, Callable[[], type]]):
    """Name -> lazy class loader; shared by both factories. A ``dict``, as
    vLLM's ``_registry``, so code that looks a name up in it or removes one
    (test clean-up, capability checks) works unchanged."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str, module_path_or_cls: str | type, class_name: str | None) -> None:
        if name in self:
            raise ValueError(f"{self.kind} '{name}' is already registered.")
        if isinstance(module_path_or_cls, str):
            if class_name is None:
                raise ValueError("class_name is required when registering with module path")
            module_path = module_path_or_cls

            def loader() -> type:
                return getattr(importlib.import_module(module_path), class_name)

            self[name] = loader
        else:
            engine_cls = module_path_or_cls
            self[name] = lambda: engine_cls

    def load(self, name: str) -> type:
        if name not in self:
            raise ValueError(
                f"Invalid weight transfer backend: {name!r}. "
                f"Available {self.kind}s: {sorted(self)}"
            )
        return self[name]()


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
        return sorted(cls._registry)

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
        return sorted(cls._registry)

    @classmethod
    def engine_class(cls, backend: str) -> type[TrainerWeightTransferEngine]:
        """The trainer engine class of ``backend`` (``ValueError`` if unknown)."""
        return cls._registry.load(backend)

    @overload
    @classmethod
    def trainer_init(
        cls,
        init_info: Any | Mapping[str, Any],
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> TrainerWeightTransferEngine: ...

    @overload
    @classmethod
    def trainer_init(
        cls,
        backend: str,
        config: Any | Mapping[str, Any],
        init_info: Any | Mapping[str, Any],
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> TrainerWeightTransferEngine: ...

    @classmethod
    def trainer_init(
        cls, *args: Any, client: VLLMWeightSyncClient, source: WeightSource | None = None, **kwargs: Any
    ) -> TrainerWeightTransferEngine:
        """Build and rendezvous a ready-to-send trainer engine.

        Two call forms, told apart by the first argument (a backend name is a
        ``str``, an init info never is):

        * released vLLM's ``trainer_init(init_info, *, client, source)``: the
          init info names its backend, as an instance of a dataclass with a
          ``backend`` class attribute (vLLM's ``NCCLTrainerInitInfo`` and
          ``IPCTrainerInitInfo``) or as a dict with a ``"backend"`` key. Its
          other fields are the backend's rendezvous and wire settings together
          (``{"backend": "torch_dist", "master_address": ..., "master_port":
          ..., "rank": 0, "packed": True}``).
        * the seed's ``trainer_init(backend, config, init_info, *, client, source)``.

        Called on every trainer rank; the sender is trainer rank 0, read from
        the init info's ``rank``. Configs and init infos may be the backend's
        dataclasses or plain dicts (from a YAML file), validated the same way.

        Raises:
            ValueError: unknown backend (the message lists the registered
                ones), or a bad/missing/unknown key.
            TypeError: arguments that fit neither form.
        """
        backend, config, init_info = _bind_call_form(args, kwargs)
        engine_cls = cls.engine_class(backend)
        if config is None:
            config, init_info = _split_flat_init_info(engine_cls, init_info)
        logger.info("Creating weight transfer trainer engine: %s", engine_cls.__name__)
        return engine_cls.trainer_init(config, init_info, client=client, source=source)


_CALL_FORMS = (
    "trainer_init(init_info, *, client, source) with an init info that names its backend, "
    "or trainer_init(backend, config, init_info, *, client, source)"
)


def _bind_call_form(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any, Any]:
    """``(backend, config, init_info)`` of either call form; ``config`` is
    ``None`` for the released form, whose init info carries everything."""
    unknown = set(kwargs) - {"backend", "config", "init_info"}
    if unknown:
        raise TypeError(f"trainer_init() got unexpected keyword arguments {sorted(unknown)}; use {_CALL_FORMS}")
    seed_form = (bool(args) and isinstance(args[0], str)) or "backend" in kwargs
    names = ("backend", "config", "init_info") if seed_form else ("init_info",)
    if len(args) > len(names) or any(name in kwargs for name in names[: len(args)]):
        raise TypeError(f"trainer_init() got arguments that fit neither call form; use {_CALL_FORMS}")
    bound = {**dict(zip(names, args)), **kwargs}
    missing = [name for name in names if name not in bound]
    if missing:
        raise TypeError(f"trainer_init() is missing {missing}; use {_CALL_FORMS}")
    if seed_form:
        return bound["backend"], bound["config"], bound["init_info"]
    info = bound["init_info"]
    if isinstance(info, Mapping):
        if not isinstance(info.get("backend"), str):
            raise ValueError(
                "init_info: a dict init info must name its backend, e.g. {'backend': 'torch_dist', ...}; "
                f"got keys {sorted(info)}"
            )
        return info["backend"], None, {k: v for k, v in info.items() if k != "backend"}
    backend = getattr(type(info), "backend", None)
    if not dataclasses.is_dataclass(info) or not isinstance(backend, str):
        raise TypeError(
            f"init_info of type {type(info).__name__} names no backend: pass a dataclass with a class "
            f"attribute backend (vLLM's TrainerInitInfo subclasses) or a dict with a 'backend' key, "
            f"or use {_CALL_FORMS}"
        )
    return backend, None, {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}


def _split_flat_init_info(engine_cls: type, fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A released-form init info (rendezvous and wire settings in one, as
    vLLM's) split by field name into the engine's ``(config, init_info)``.
    Each built-in engine's two field sets are disjoint, so every key has one home."""
    config_keys = {f.name for f in dataclasses.fields(engine_cls.config_cls)} - {"backend"}
    info_keys = {f.name for f in dataclasses.fields(engine_cls.init_info_cls)}
    accepted = sorted(config_keys | info_keys)
    for key in fields:
        if key not in config_keys | info_keys:
            hint = difflib.get_close_matches(str(key), accepted, n=1)
            raise ValueError(
                f"init_info for {engine_cls.__name__}: unknown key {key!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else "")
                + f" (accepted keys: {accepted})"
            )
    return (
        {k: v for k, v in fields.items() if k in config_keys},
        {k: v for k, v in fields.items() if k in info_keys},
    )


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
