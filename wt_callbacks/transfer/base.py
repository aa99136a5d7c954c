"""Core types of the weight-transfer system.

The public names and contracts follow vLLM's ``vllm.distributed.weight_transfer``
trainer/worker API (module ``base`` there too), so code written against vLLM's
API runs against ours and our wire dicts are the ones a vLLM server
understands. Nothing here imports vLLM: training environments rarely can
install it (it pins torch exactly).

The weight sources (``ParamMeta``, ``WeightSource``, ...) live in
``weight_source`` and the typed settings (``TrainerInitInfo``,
``parse_dataclass``) in ``infos``, the wire's dtype names in ``dtypes``, the
bounded waits in ``deadlines``, ``WeightTransferError`` in ``errors``, and
``ModuleSource`` in ``sources`` (with a gatherer per sharding scheme); they are
importable from here, where vLLM defines them.
"""

from __future__ import annotations

import inspect
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import torch

from wt_callbacks.transfer.deadlines import CLEANUP_TIMEOUT_S, best_effort, bounded, in_daemon_thread
from wt_callbacks.transfer.dtypes import dtype_from_name, dtype_name
from wt_callbacks.transfer.errors import WeightTransferError
from wt_callbacks.transfer.infos import (
    TrainerInitInfo,
    fields_of,
    parse_dataclass,
    released_config,
    resolve_settings,
)
from wt_callbacks.transfer.sources import ModuleSource
from wt_callbacks.transfer.weight_source import (
    Metadata,
    ParamMeta,
    Placement,
    Replicate,
    Shard,
    WeightSource,
    check_full_tensors,
    check_sender_owns_all,
    drain,
    materialize_full_tensor,
    source_metadata,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "CLEANUP_TIMEOUT_S",
    "Metadata",
    "ModuleSource",
    "ParamMeta",
    "Placement",
    "Replicate",
    "Shard",
    "TrainerInitInfo",
    "TrainerWeightTransferEngine",
    "TransferStats",
    "VLLMWeightSyncClient",
    "WeightSource",
    "WeightTransferConfig",
    "WeightTransferEngine",
    "WeightTransferError",
    "WeightTransferInitInfo",
    "WeightTransferInitRequest",
    "WeightTransferUpdateInfo",
    "WeightTransferUpdatePayload",
    "WeightTransferUpdateRequest",
    "best_effort",
    "bounded",
    "check_full_tensors",
    "check_sender_owns_all",
    "drain",
    "dtype_from_name",
    "dtype_name",
    "fields_of",
    "finish_with_version",
    "in_daemon_thread",
    "materialize_full_tensor",
    "parse_dataclass",
    "source_metadata",
]


logger = logging.getLogger(__name__)

WeightTransferUpdatePayload = dict[str, Any] | list[dict[str, Any]]
"""What ``update_weights`` carries: one dict for every worker, or a list with
one dict per global worker rank (the worker picks its own entry)."""


# --------------------------------------------------------------------------- #
# Init / update info bases and request envelopes
# --------------------------------------------------------------------------- #


@dataclass
class WeightTransferConfig:
    """Server-side config: which registered backend a worker runs.

    Mirrors vLLM's ``--weight-transfer-config '{"backend": ...}'``. Trainer
    engines subclass it with their own settings (packing, wire dtype, ...).
    """

    backend: str = "torch_dist"


@dataclass
class WeightTransferInitInfo(ABC):  # noqa: B024 - a typed marker base, as in vLLM
    """Base for backend-specific initialization info."""


@dataclass
class WeightTransferUpdateInfo(ABC):  # noqa: B024
    """Base for backend-specific per-round update info."""


@dataclass
class WeightTransferInitRequest:
    """Envelope of ``init_weight_transfer_engine`` for Ray / ``LLM`` actors."""

    init_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    """Envelope of ``update_weights`` for Ray / ``LLM`` actors."""

    update_info: WeightTransferUpdatePayload = field(default_factory=dict)


# --------------------------------------------------------------------------- #
# Control plane protocol (trainer -> inference engine)
# --------------------------------------------------------------------------- #


@runtime_checkable
class VLLMWeightSyncClient(Protocol):
    """Trainer-side stub for the inference engine's weight-sync control plane.

    Mirrors the weight-sync methods a vLLM server exposes (the HTTP RL routes,
    ``LLM``/``AsyncLLM`` Ray actors). Engines drive the whole handshake through
    it, so trainer code never depends on the transport.

    All methods are synchronous and take plain dicts. Concurrency some
    backends need (``update_weights`` must run while the trainer broadcasts)
    is the engine's job, so any wrapper can implement this flat surface.
    ``finish_weight_update`` takes the round's ``weight_version`` (as in
    vLLM 0.32 and 0.33); engines pass it only when a version is set, so a
    client whose ``finish_weight_update()`` takes no argument (the seed's)
    still conforms.

    Structural (PEP 544): define the methods, no import or subclassing needed.
    """

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


def finish_with_version(client: VLLMWeightSyncClient, weight_version: str | None) -> None:
    """Call ``client.finish_weight_update`` tagging ``weight_version``.

    Clients with vLLM 0.32's ``finish_weight_update(weight_version=None)`` get
    the version in the same call; the seed's no-argument form gets a plain
    finish, then ``update_weight_version`` if the client has it.
    """
    if weight_version is None:
        client.finish_weight_update()
        return
    try:
        params = inspect.signature(client.finish_weight_update).parameters
    except (TypeError, ValueError):
        params = {}
    if "weight_version" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    ):
        client.finish_weight_update(weight_version=weight_version)  # type: ignore[call-arg]
        return
    client.finish_weight_update()
    update_version = getattr(client, "update_weight_version", None)
    if callable(update_version):
        update_version(weight_version)


# --------------------------------------------------------------------------- #
# Trainer engine
# --------------------------------------------------------------------------- #


@dataclass
class TransferStats:
    """What the last ``send_weights`` round did on this rank (for metrics)."""

    bytes: int = 0
    tensors: int = 0
    seconds: float = 0.0
    gather_seconds: float = 0.0


TInitInfo = TypeVar("TInitInfo")
TUpdateInfo = TypeVar("TUpdateInfo")
TTrainerInitInfo = TypeVar("TTrainerInitInfo", bound=TrainerInitInfo)


class TrainerWeightTransferEngine(ABC, Generic[TTrainerInitInfo]):
    """Trainer-side weight transfer engine.

    Symmetric to ``WeightTransferEngine`` but lives in the training process.
    Built by ``trainer_init`` (usually through ``WeightTransferTrainerFactory``),
    it carries the backend's state (process group, transfer plan) on ``self``.
    The ``WeightSource`` given at ``trainer_init`` is replayed each round by
    ``send_weights()``.

    Multi-rank trainers: ``trainer_init`` and ``send_weights`` are called on
    *every* trainer rank. Trainer rank 0 (``init_info.rank``) is the sender.
    Non-sender ranks still iterate the source each round, because the FSDP
    gathers in it are collectives that every rank must join, but they never
    call the client: only the sender touches the wire.

    Two ways to write one; ``WeightTransferTrainerFactory.register_engine``
    takes both and tells them apart by ``trainer_init``'s parameters:

    * as released vLLM documents it: ``init_info_cls`` (a ``TrainerInitInfo``
      subclass carrying the rendezvous and the wire fields), the constructor
      ``(*, client, source=None, is_sender=True, rank=0)``, the classmethod
      ``trainer_init(init_info, *, client, source=None)`` and ``send_weights()``;
    * as this project's engines are written: a ``config_cls`` too (settings
      beyond vLLM's fields: wire dtype, timeouts, transport), the classmethod
      ``trainer_init(config, init_info, *, client, source)`` (each an
      instance or a plain dict; ``config=None`` is released vLLM's form, the
      init info alone) and ``send_weights(weight_version=None)``, which tags
      the round with the version the servers report.
    """

    init_info_cls: type[TTrainerInitInfo]
    config_cls: ClassVar[type | None] = None

    def __init__(
        self,
        config: Any = None,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        rank: int = 0,
    ) -> None:
        self.config = config
        self.is_sender = is_sender
        self.rank = rank
        # Every rank holds the client, only the sender calls it.
        self.client = client
        self.source = source
        self.last_stats = TransferStats()

    @classmethod
    def takes_config(cls) -> bool:
        """Whether ``trainer_init`` takes a config (this project's form) or
        the init info alone (released vLLM's)."""
        return "config" in inspect.signature(cls.trainer_init).parameters

    @classmethod
    def parse_config(cls, config: Any | Mapping[str, Any] | None) -> Any:
        """The typed config; ``None`` for an engine without ``config_cls``,
        which refuses any setting given as config (they belong in its init info)."""
        if cls.config_cls is None:
            if config is None or (isinstance(config, Mapping) and not config):
                return None
            raise ValueError(
                f"{cls.__name__} takes no config: give its settings in the init info "
                f"({cls.init_info_cls.__name__}), got config {config!r}"
            )
        return parse_dataclass(cls.config_cls, {} if config is None else config, what=f"config for {cls.__name__}")

    @classmethod
    def parse_init_info(cls, init_info: Any) -> TTrainerInitInfo:
        """The typed init info, from an instance of ``init_info_cls``, a dict,
        or another init info object of the same backend (vLLM's own class,
        read field by field)."""
        if not isinstance(init_info, (cls.init_info_cls, Mapping)):
            init_info = fields_of(init_info)
        return parse_dataclass(cls.init_info_cls, init_info, what=f"init_info for {cls.__name__}")

    @classmethod
    def parse_settings(cls, config: Any, init_info: Any) -> tuple[Any, TTrainerInitInfo]:
        """``(config, init_info)``, typed, each wire field holding one value
        (``infos.resolve_settings``). ``config=None``: released vLLM's form,
        the init info alone, its wire values (vLLM's defaults included) in force."""
        info = cls.parse_init_info(init_info)
        if cls.config_cls is None:
            return cls.parse_config(config), info
        if config is None:
            config = released_config(cls.config_cls, info)
        return resolve_settings(cls.parse_config(config), info)

    @classmethod
    @abstractmethod
    def trainer_init(
        cls, *args: Any, client: VLLMWeightSyncClient, source: WeightSource | None = None, **kwargs: Any
    ) -> Self:
        """Rendezvous with the inference side and return a ready instance:
        ``(init_info, *, client, source=None)`` or ``(config, init_info, *,
        client, source)``, as the class docstring says.

        Called on every trainer rank. The sender drives the handshake through
        ``client``; non-sender ranks skip the rendezvous and the RPC. Settings
        the backend cannot honour are refused here, naming the field, before
        any server is called.
        """
        raise NotImplementedError

    @abstractmethod
    def send_weights(self, weight_version: str | None = None) -> None:
        """Push ``self.source``'s weights and drive the whole round trip:
        ``start_weight_update``, ``update_weights`` (concurrently with the
        broadcast when the backend requires it), ``finish_weight_update``
        (tagged with ``weight_version`` when given). Called on every rank."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Tear down process groups / communicators. Default no-op."""


# --------------------------------------------------------------------------- #
# Worker engine (inference side)
# --------------------------------------------------------------------------- #


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    """Inference-side engine: receives weights and loads them into the model.

    Each engine owns its update lifecycle: ``start_weight_update``, one or
    more ``update_weights``, ``finish_weight_update``. Weights are applied
    through ``self.model.load_weights(iterable of (name, tensor))``, the
    method vLLM models use to map checkpoint names onto fused parameters;
    hosts that are not vLLM (the reference receiver) point the engine at a
    target with the same method through ``set_weight_update_target``.

    ``vllm_config`` needs ``parallel_config`` (``data_parallel_index``,
    ``world_size``, ``rank``) and ``model_config``; the reference receiver
    passes a small namespace with those attributes.
    """

    init_info_cls: type[TInitInfo]
    update_info_cls: type[TUpdateInfo]

    supports_draft_weight_update: bool = True

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: Any,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.model = model
        self._default_model_config = self.model_config
        self._default_model = model

    def set_weight_update_target(self, model: Any, model_config: Any) -> None:
        """Set the model that will receive the active weight update."""
        self.model = model
        self.model_config = model_config

    def reset_weight_update_target(self) -> None:
        """Restore weight updates to the engine's default target model."""
        self.model = self._default_model
        self.model_config = self._default_model_config

    def parse_init_info(self, init_dict: Mapping[str, Any]) -> TInitInfo:
        """Typed init info from a dict; ``ValueError`` naming the bad key."""
        return parse_dataclass(
            self.init_info_cls, init_dict, what=f"Invalid init_info for {type(self).__name__}"
        )

    def parse_update_info(self, update_dict: Mapping[str, Any]) -> TUpdateInfo:
        """Typed update info from a dict; ``ValueError`` naming the bad key."""
        return parse_dataclass(
            self.update_info_cls, update_dict, what=f"Invalid update_info for {type(self).__name__}"
        )

    @abstractmethod
    def init_transfer_engine(self, init_info: TInitInfo) -> None:
        """Join the transfer group. Called once per trainer rendezvous."""
        raise NotImplementedError

    @abstractmethod
    def start_weight_update(self) -> None:
        """Prepare the engine for a new weight update."""
        raise NotImplementedError

    @abstractmethod
    def finish_weight_update(self) -> None:
        """Finalize the current weight update."""
        raise NotImplementedError

    def update_weights(self, update_info: Mapping[str, Any]) -> None:
        """Receive one update and load it into the model.

        Synchronizes the accelerator afterwards so the next step sees the new
        weights; on a CPU-only host there is nothing to synchronize (and
        ``torch.accelerator.synchronize()`` would raise).
        """
        typed_update_info = self.parse_update_info(update_info)
        self.receive_weights(typed_update_info)
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    @abstractmethod
    def receive_weights(self, update_info: TUpdateInfo) -> None:
        """Receive weights from the trainer and load them into the model."""
        raise NotImplementedError

    @abstractmethod
    def shutdown(self) -> None:
        """Leave the transfer group."""
        raise NotImplementedError

    @staticmethod
    def trainer_send_weights(iterator: Iterator[Any], trainer_args: dict[str, Any] | Any) -> None:
        """The seed's call style: send ``iterator``'s items from the trainer
        with backend-specific ``trainer_args`` (e.g. the process group). Not
        abstract: released vLLM dropped it for trainer engines, and a worker
        engine written for it (without this method) must still be built."""
        raise NotImplementedError(
            "this engine has no trainer_send_weights: build a trainer engine with "
            "WeightTransferTrainerFactory.trainer_init and call its send_weights()"
        )
