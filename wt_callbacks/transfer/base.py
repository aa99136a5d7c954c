"""Core types of the weight-transfer system.

The public names and contracts follow vLLM's ``vllm.distributed.weight_transfer``
trainer/worker API, so code written against vLLM's API runs against ours and
our wire dicts are the ones a vLLM server understands. Nothing here imports
vLLM: training environments rarely can install it (it pins torch exactly).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import threading
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

import torch

if TYPE_CHECKING:
    from typing_extensions import Self

logger = logging.getLogger(__name__)

WeightTransferUpdatePayload = dict[str, Any] | list[dict[str, Any]]
"""What ``update_weights`` carries: one dict for every worker, or a list with
one dict per global worker rank (the worker picks its own entry)."""


class WeightTransferError(RuntimeError):
    """A sync round or a rendezvous failed; the message says what to fix."""


# --------------------------------------------------------------------------- #
# dtype names on the wire
# --------------------------------------------------------------------------- #


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype: its torch attribute name (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, *, key: str = "dtype") -> torch.dtype:
    """Decode a wire dtype name; ``ValueError`` naming ``key`` if it is not one."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        known = sorted(n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype))
        hint = difflib.get_close_matches(str(name), known, n=1)
        raise ValueError(
            f"{key}={name!r} is not a torch dtype name"
            + (f"; did you mean {hint[0]!r}?" if hint else f"; use one of {known}")
        )
    return value


# --------------------------------------------------------------------------- #
# Typed config / info parsing (dataclass from dict, with errors naming the key)
# --------------------------------------------------------------------------- #

TInfo = TypeVar("TInfo")


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


# --------------------------------------------------------------------------- #
# Weight sources (trainer side)
# --------------------------------------------------------------------------- #


def materialize_full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Return the full (unsharded) tensor.

    An FSDP2 ``DTensor`` is all-gathered through ``full_tensor()``, which is a
    collective: every rank of the mesh must call it, in the same order. Other
    tensors pass through unchanged.
    """
    full_tensor = getattr(tensor, "full_tensor", None)
    if callable(full_tensor):
        return full_tensor()
    return tensor


@dataclass(frozen=True)
class ParamMeta:
    """Name / wire dtype / full (checkpoint) shape for one output parameter."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize


class WeightSource(ABC):
    """A re-iterable source of the trainer's weights, handed to a trainer engine.

    Two channels:

    * ``metadata()``: ``(name, wire dtype, full shape)`` for every parameter,
      without transferring anything. Receivers size their buffers and the
      packed chunk boundaries from it, so it must agree with iteration element
      for element (same names, order, dtypes, shapes); engines check this and
      name the first disagreement.
    * iteration: yields fully materialized ``(name, tensor)`` pairs, one at a
      time. Materializing is typically a collective (FSDP ``full_tensor()``),
      so every trainer rank must iterate the same source in the same order in
      lockstep, or ranks deadlock. ``iter(source)`` yields a fresh pass each
      round. A yielded tensor must stay valid and unchanged until the round
      ends: a transport may read it after the next ones were yielded (the
      shared-memory ring streams chunks straight from them), so a source
      must not refill one scratch buffer for several tensors.
    """

    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        raise NotImplementedError

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def iter_uncast(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Iteration for a consumer that casts as it copies (the packed transports).

        The same pairs as iteration, except that a floating-point tensor may
        come in another floating-point dtype than its ``metadata()`` dtype;
        the consumer converts it to the metadata (wire) dtype in the copy it
        makes anyway, instead of the source making a converted temporary.
        Sources that gather still cast before the gather (half the gathered
        bytes for a bf16 wire). The default is plain iteration.
        """
        return iter(self)

    def gather_only(self) -> Iterator[str]:
        """One pass as a trainer rank that does not send runs it.

        Such a rank iterates only so that the gathers (collectives) of the
        pass happen on every rank, in the same order; it drops the tensors.
        This runs those same collectives and yields each tensor's name once
        its gathers are done, but need not produce the full tensors: a
        source that gathers can skip building them (their allocation and
        the copies into them), which on a host whose cores the ranks share
        is time the sending rank waits for at its next collective. A
        partly consumed pass must still be iterated to the end (``drain``).
        The default iterates and drops the tensors.
        """
        return (name for name, _ in self.iter_uncast())

    def with_wire_dtype(self, dtype: torch.dtype | None) -> WeightSource:
        """This source, yielding (and describing) tensors in ``dtype``.

        The default casts after materializing. Sources that can cast before an
        FSDP gather (``ModuleSource``) override it: casting first halves the
        all-gather bytes and the gathered memory for a bf16 wire.
        """
        if dtype is None:
            return self
        return _CastSource(self, dtype)


def drain(items: Iterable[Any]) -> None:
    """Finish iterating a source after a failed round.

    The other trainer ranks are still in the same pass, each tensor an FSDP
    gather they expect this rank to join; stopping here would deadlock them.
    Errors are logged, never raised: the round already failed.
    """
    try:
        for _ in items:
            pass
    except Exception:  # noqa: BLE001 - already failing; never mask the first error
        logger.warning("draining the weight source after a failed round failed", exc_info=True)


CLEANUP_TIMEOUT_S = 10.0
"""Bound on the best-effort calls after a failed round (ending a server's
update, resuming generation), at most ``timeout_s`` each: the round already
failed, and a server that stopped answering must not hold the error back by
another full ``timeout_s`` per call."""


def in_daemon_thread(fn: Callable[[], Any], name: str) -> Future:
    """Run ``fn`` on a daemon thread: a server call stuck past our timeout
    must not keep the training process alive at exit."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def bounded(fn: Callable[[], Any], what: str, *, within_s: float, peer: str = "server") -> Any:
    """``fn()``, waiting at most ``within_s`` for it (``WeightTransferError``
    past that): a config's ``timeout_s`` bounds a server call whatever
    timeout the client was built with. A call still running past the bound
    carries on in the background (its own timeout ends it, or the peer's
    death). ``peer``: who failed to answer, for the message (a worker's calls
    wait on the trainer)."""
    future = in_daemon_thread(fn, f"wt-{what}")
    try:
        # exception(), not result(): the call's own TimeoutError (a socket's)
        # is then the call's error, not "no answer".
        error = future.exception(timeout=within_s)
    except FutureTimeout:
        raise WeightTransferError(
            f"{what}: no answer within {within_s:.3g} s; not waiting for it (the {peer} is frozen or "
            "overloaded; raise timeout_s if it is just slow)"
        ) from None
    if error is not None:
        raise error
    return future.result()


def best_effort(fn: Callable[[], Any], what: str, *, within_s: float) -> Exception | None:
    """``bounded`` after a failure: returns the call's error instead of raising it."""
    try:
        bounded(fn, what, within_s=within_s)
    except Exception as e:  # noqa: BLE001 - reported to the caller, whose own error matters more
        return e
    return None


class _CastSource(WeightSource):
    def __init__(self, inner: WeightSource, dtype: torch.dtype) -> None:
        self._inner = inner
        self._dtype = dtype

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(m.name, self._dtype if m.dtype.is_floating_point else m.dtype, m.shape)
            for m in self._inner.metadata()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._inner:
            yield name, tensor.to(self._dtype) if tensor.is_floating_point() else tensor

    def iter_uncast(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._inner.iter_uncast()

    def gather_only(self) -> Iterator[str]:
        return self._inner.gather_only()


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
    ``finish_weight_update`` may take the round's ``weight_version`` (vLLM
    0.32 does); engines pass it only when a version is set, so a client whose
    ``finish_weight_update()`` takes no argument still conforms.

    Structural (PEP 544): define the methods, no import or subclassing needed.
    """

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None: ...

    def finish_weight_update(self) -> None: ...


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

TConfig = TypeVar("TConfig")
TInitInfo = TypeVar("TInitInfo")
TUpdateInfo = TypeVar("TUpdateInfo")


class TrainerWeightTransferEngine(ABC, Generic[TConfig, TInitInfo]):
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

    Subclasses define ``init_info_cls`` and ``config_cls``; ``trainer_init``
    accepts instances of them or plain dicts (validated the same way).
    """

    init_info_cls: type[TInitInfo]
    config_cls: type[TConfig]

    def __init__(
        self,
        config: TConfig,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool = True,
    ) -> None:
        self.config = config
        self.is_sender = is_sender
        # Every rank holds the client, only the sender calls it.
        self.client = client
        self.source = source
        self.last_stats = TransferStats()

    @classmethod
    def parse_config(cls, config: TConfig | Mapping[str, Any]) -> TConfig:
        return parse_dataclass(cls.config_cls, config, what=f"config for {cls.__name__}")

    @classmethod
    def parse_init_info(cls, init_info: TInitInfo | Mapping[str, Any]) -> TInitInfo:
        return parse_dataclass(cls.init_info_cls, init_info, what=f"init_info for {cls.__name__}")

    @classmethod
    @abstractmethod
    def trainer_init(
        cls,
        config: TConfig | Mapping[str, Any],
        init_info: TInitInfo | Mapping[str, Any],
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
    ) -> Self:
        """Rendezvous with the inference side and return a ready instance.

        Called on every trainer rank. The sender drives the handshake through
        ``client``; non-sender ranks skip the rendezvous and the RPC.
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
    @abstractmethod
    def trainer_send_weights(iterator: Iterator[Any], trainer_args: dict[str, Any] | Any) -> None:
        """Older call style: send ``iterator``'s items from the trainer with
        backend-specific ``trainer_args`` (e.g. the process group)."""
        raise NotImplementedError
