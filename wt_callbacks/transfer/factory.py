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
from wt_callbacks.transfer.infos import fields_of, released_config

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
        init_info: Any,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> TrainerWeightTransferEngine: ...

    @overload
    @classmethod
    def trainer_init(
        cls,
        backend: str,
        config: Any | Mapping[str, Any] | None,
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

        * released vLLM's ``trainer_init(init_info, *, client, source=None)``:
          the init info names its backend through its class-level ``backend``
          (a ``TrainerInitInfo`` subclass: this project's, vLLM's own, or any
          object with a ``backend`` attribute) or a ``"backend"`` key (a
          dict). It carries the rendezvous and the wire fields; a dict may
          add this project's settings beyond vLLM's (``dtype``, ``timeout_s``,
          ...): ``{"backend": "torch_dist", "master_address": ...,
          "master_port": 0, "rank": 0, "packed": True}``.
        * the seed's ``trainer_init(backend, config, init_info, *, client, source)``,
          each a dataclass or a plain dict (from a YAML file).

        Engines of both forms are served, however registered: one written as
        released vLLM documents it (no config, ``trainer_init(init_info, *,
        client, source)``) gets its init info as given, or built from a dict;
        one of this project's form (``config_cls``, ``trainer_init(config,
        init_info, ...)``) gets the two split out of the released form.

        Called on every trainer rank; the sender is trainer rank 0, read from
        the init info's ``rank``.

        Raises:
            ValueError: unknown backend (``Invalid weight transfer backend``,
                listing the registered ones) for any init info, a bad, missing
                or unknown key, or a setting the backend cannot honour, named
                before any server is called.
            TypeError: arguments that fit neither form.
        """
        backend, config, init_info, released = _bind_call_form(args, kwargs)
        engine_cls = cls.engine_class(backend)
        logger.info("Creating weight transfer trainer engine: %s", engine_cls.__name__)
        if not engine_cls.takes_config():
            # Released vLLM's engine contract: the init info is everything.
            if not released:
                engine_cls.parse_config(config)  # refuses settings it would drop
            if isinstance(init_info, Mapping):
                init_info = engine_cls.parse_init_info({k: v for k, v in init_info.items() if k != "backend"})
            return engine_cls.trainer_init(init_info=init_info, client=client, source=source)
        if released:
            config, init_info = _split_flat_init_info(engine_cls, init_info)
        return engine_cls.trainer_init(config, init_info, client=client, source=source)


_CALL_FORMS = (
    "trainer_init(init_info, *, client, source) with an init info that names its backend, "
    "or trainer_init(backend, config, init_info, *, client, source)"
)


def _bind_call_form(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any, Any, bool]:
    """``(backend, config, init_info, released)`` of either call form; the
    released form has no config (``None``): its init info carries everything."""
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
        return bound["backend"], bound["config"], bound["init_info"], False
    info = bound["init_info"]
    backend = info.get("backend") if isinstance(info, Mapping) else getattr(info, "backend", None)
    if not isinstance(backend, str):
        if isinstance(info, Mapping):
            why = "a dict init info must name its backend, e.g. {'backend': 'torch_dist', ...}"
        else:
            why = (
                f"init_info of type {type(info).__name__} names no backend: give its class a class-level "
                "backend (a TrainerInitInfo subclass)"
            )
        raise ValueError(f"init_info: {why}; or use {_CALL_FORMS}")
    return backend, None, info, True


def _split_flat_init_info(engine_cls: type[TrainerWeightTransferEngine], info: Any) -> tuple[Any, Any]:
    """Released vLLM's form for an engine of this project's: ``(config,
    init_info)`` out of one init info. Its own fields make the init info;
    the config gets the rest of a dict's keys (this project's settings) and
    the init info's wire fields, vLLM's defaults included
    (``infos.released_config``)."""
    fields = fields_of(info)
    init_keys = {f.name for f in dataclasses.fields(engine_cls.init_info_cls) if f.init}
    config_keys = {f.name for f in dataclasses.fields(engine_cls.config_cls)} - {"backend"}
    accepted = sorted(config_keys | init_keys)
    for key in fields:
        if key not in accepted:
            hint = difflib.get_close_matches(str(key), accepted, n=1)
            raise ValueError(
                f"init_info for {engine_cls.__name__}: unknown key {key!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else "")
                + f" (accepted keys: {accepted})"
            )
    init_info = engine_cls.parse_init_info({k: v for k, v in fields.items() if k in init_keys})
    extras = {k: v for k, v in fields.items() if k not in init_keys}
    return released_config(engine_cls.config_cls, init_info, extras), init_info


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
