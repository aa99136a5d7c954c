"""Typed trainer settings: parsed from dicts with errors naming the key, and
the two shapes a trainer gives them in.

* Released vLLM's: one ``TrainerInitInfo`` subclass per backend carries the
  rendezvous and the wire fields (``packed``, ``packed_buffer_size_bytes``,
  ``packed_num_buffers``) with vLLM's defaults, and its class-level
  ``backend`` names the engine: ``trainer_init(init_info, *, client, source)``.
* The seed's, which this project's engines keep: a backend config (wire
  fields, wire dtype, timeouts, transport) next to the init info:
  ``trainer_init(backend, config, init_info, ...)``, each a dataclass or a
  plain dict (from YAML).

A wire field then exists in both; ``resolve_settings`` gives it one value,
so that the worker is told one thing and the sender does that thing.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

TInfo = TypeVar("TInfo")
TConfig = TypeVar("TConfig")

VLLM_PACKED_BUFFER_SIZE_BYTES = 1024**3
"""vLLM's default ``packed_buffer_size_bytes`` (its ``packed_tensor`` module's),
on its trainer init infos and its worker's."""
VLLM_PACKED_NUM_BUFFERS = 2
"""vLLM's default ``packed_num_buffers``."""


@dataclass
class TrainerInitInfo:
    """Base of every trainer init info: which trainer rank this process is.

    ``rank`` is given explicitly (keyword-only, so that a subclass's own
    fields keep their positions): with several process groups (FSDP, TP,
    PP) no global group says which rank drives the transfer. Rank 0 is the
    sender; every rank still runs the trainer-side collectives.

    Every concrete subclass sets a class-level ``backend``, the name its
    trainer engine is registered under: the factory dispatches on it, so a
    caller hands over the init info alone. A subclass without one is
    refused when it is defined (``TypeError``), not at the first sync.
    """

    backend: ClassVar[str]
    rank: int = field(kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        backend = getattr(cls, "backend", None)
        if not isinstance(backend, str) or not backend:
            raise TypeError(
                f"{cls.__name__} must set a class-level backend string: the name its trainer engine "
                "is registered under with WeightTransferTrainerFactory.register_engine"
            )

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank must be >= 0 (an int: this process's trainer rank), got {self.rank!r}")

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


def _type_ok(value: Any, annotation: Any) -> bool:
    """Shallow runtime check for the scalar field types our infos use."""
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple) or annotation in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict or annotation is dict:
        return isinstance(value, Mapping)
    return True


def parse_dataclass(cls: type[TInfo], value: TInfo | Mapping[str, Any], *, what: str) -> TInfo:
    """Build dataclass ``cls`` from an instance of it or from a plain mapping.

    Config files and JSON bodies arrive as dicts; engines want typed infos.
    Unknown keys (with a did-you-mean), missing required keys and values of the
    wrong type raise ``ValueError`` naming the key, so the person editing the
    YAML knows what to change. ``__post_init__`` checks run as usual.
    """
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a {cls.__name__} or a dict, got {type(value).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    for key in value:
        if key not in fields:
            hint = difflib.get_close_matches(str(key), list(fields), n=1)
            raise ValueError(
                f"{what}: unknown key {key!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else "")
                + f" (accepted keys: {sorted(fields)})"
            )
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in value:
            raise ValueError(f"{what}: missing required key {name!r}")
        if name in value and not _type_ok(value[name], hints.get(name, Any)):
            raise ValueError(
                f"{what}: key {name!r} must be of type {hints.get(name)}, "
                f"got {type(value[name]).__name__} {value[name]!r}"
            )
    try:
        return cls(**dict(value))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: {e}") from e


def fields_of(info: Any) -> dict[str, Any]:
    """The settings an init info object carries, as a dict: a dataclass's
    fields (vLLM's own init infos are dataclasses), a mapping's items, or any
    other object's public attributes; never its class-level ``backend``."""
    if isinstance(info, Mapping):
        items = dict(info)
    elif dataclasses.is_dataclass(info) and not isinstance(info, type):
        items = {f.name: getattr(info, f.name) for f in dataclasses.fields(info) if f.init}
    else:
        items = {k: v for k, v in vars(info).items() if not k.startswith("_")}
    items.pop("backend", None)
    return items


def shared_fields(config_cls: type, init_info_cls: type) -> list[str]:
    """The fields a backend's config and its init info both have: the wire
    fields released vLLM moved into the init info."""
    config_names = {f.name for f in dataclasses.fields(config_cls)}
    return [f.name for f in dataclasses.fields(init_info_cls) if f.init and f.name in config_names]


def _default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def released_config(config_cls: type[TConfig], init_info: Any, extras: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config of released vLLM's form, where the init info holds every
    wire field: ``extras`` (this project's settings beyond vLLM's, from a
    flat dict) and the init info's wire values, its defaults (vLLM's)
    included, so they win over the config's own defaults."""
    return {**(extras or {}), **{n: getattr(init_info, n) for n in shared_fields(config_cls, type(init_info))}}


def resolve_settings(config: TConfig, init_info: TInfo) -> tuple[TConfig, TInfo]:
    """One value for every field the config and the init info share.

    A value counts as given when it differs from its class's default. Given
    in one: that value. In neither: the config's default (the backend's own,
    e.g. this project's 64 MiB chunks; released vLLM's form reaches here
    through ``released_config``, whose values are the init info's). Given in
    both, differently: ``ValueError`` naming the field, before any server
    is called. A config default of ``None`` means "the init info's" (the
    vLLM backends' ``packed``, whose default differs per backend). Both
    objects come back holding the one value.
    """
    chosen: dict[str, Any] = {}
    for name in shared_fields(type(config), type(init_info)):
        in_config, in_info = getattr(config, name), getattr(init_info, name)
        config_given = in_config != _default(type(config), name)
        info_given = in_info != _default(type(init_info), name)
        if config_given and info_given and in_config != in_info:
            raise ValueError(
                f"{name} is {in_config!r} in the config but {in_info!r} in the init info: "
                "give it in one of them"
            )
        chosen[name] = in_config if config_given or not (info_given or in_config is None) else in_info
    if not chosen:
        return config, init_info
    return dataclasses.replace(config, **chosen), dataclasses.replace(init_info, **chosen)  # type: ignore[type-var]
