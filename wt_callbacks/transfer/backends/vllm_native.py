"""Backends ``nccl`` and ``ipc``: stock vLLM's own wire, for GPU trainers.

A server running stock vLLM (no plugin) speaks only its built-in backends.
These trainer engines drive them by calling vLLM's own trainer-side code
(``NCCLTrainerWeightTransferEngine``, ``IPCTrainerWeightTransferEngine``), so
the bytes on the wire are exactly vLLM's. That needs ``vllm`` importable in
the trainer (and CUDA); without it, ``trainer_init`` fails with the fix
instead of at the first sync. Where vLLM cannot be installed next to the
trainer, use ``torch_dist`` with the wt-callbacks plugin in the server.

What these adapters add to vLLM's engines: dict configs (YAML), the world
size asked from the client, the wire-dtype cast before the FSDP gather (our
``WeightSource.with_wire_dtype``), and the round's weight version.

vLLM 0.32 and 0.33 are spoken (their trainer-side ``WeightSource`` differs);
another release is refused by name. The trainer's vLLM must be the servers'
release: 0.33 sends an empty update info when the metadata did not change,
which a 0.32 server refuses.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from wt_callbacks.transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    TransferStats,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferConfig,
    check_full_tensors,
    check_sender_owns_all,
    drain,
    dtype_from_name,
    dtype_name,
    source_metadata,
)
from wt_callbacks.transfer.clients import HTTPVLLMWeightSyncClient
from wt_callbacks.transfer.server_group import group_world_size
from wt_callbacks.transfer.infos import VLLM_PACKED_BUFFER_SIZE_BYTES, VLLM_PACKED_NUM_BUFFERS
from wt_callbacks.transfer.validation import check_wire_fields, parse_wire_dtype


@dataclass
class VLLMNativeTrainerConfig(WeightTransferConfig):
    """Settings of the ``nccl`` / ``ipc`` trainer engines (vLLM's own defaults).

    The packing fields are the init infos' too, where vLLM keeps them; a
    value set in one is used (set in both, differently, refused at
    ``trainer_init``).
    """

    backend: str = "nccl"
    packed: bool | None = None
    """``None``: the init info's (vLLM's default: ``nccl`` packed, ``ipc`` not)."""
    packed_buffer_size_bytes: int = VLLM_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = VLLM_PACKED_NUM_BUFFERS
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("nccl", "ipc"):
            raise ValueError(f"backend must be 'nccl' or 'ipc' for this config, got {self.backend!r}")
        check_wire_fields(self)
        if self.dtype is not None:
            parse_wire_dtype(self.dtype)


@dataclass
class NCCLTrainerInitInfo(TrainerInitInfo):
    """vLLM's ``NCCLTrainerInitInfo``: the same fields, positions and defaults,
    with ``world_size`` optional (1 + the servers' world size, asked from the
    client). The packing fields go to the workers at init, as in vLLM."""

    backend: ClassVar[str] = "nccl"  # the factory dispatches on it
    master_address: str
    master_port: int
    world_size: int | None = None
    packed: bool = True
    packed_buffer_size_bytes: int = VLLM_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = VLLM_PACKED_NUM_BUFFERS

    def __post_init__(self) -> None:
        super().__post_init__()
        check_wire_fields(self)


@dataclass
class IPCTrainerInitInfo(TrainerInitInfo):
    """vLLM's ``IPCTrainerInitInfo``: no rendezvous (the trainer and the
    server share the GPUs); unpacked by default, and one shared buffer of
    ``packed_buffer_size_bytes`` when packed."""

    backend: ClassVar[str] = "ipc"
    packed: bool = False
    packed_buffer_size_bytes: int = VLLM_PACKED_BUFFER_SIZE_BYTES

    def __post_init__(self) -> None:
        super().__post_init__()
        check_wire_fields(self)


def _import_vllm(backend: str, module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ValueError(
            f"backend {backend!r} drives vLLM's own transport and needs vllm importable in the "
            f"trainer ({e}). Install the vllm version your servers run into the training "
            "environment, or use backend 'torch_dist' with wt-callbacks installed in the server"
        ) from e


SUPPORTED_VLLM_RELEASES = ("0.32", "0.33")
"""vLLM releases whose trainer-side ``WeightSource`` these adapters speak."""


def _vllm_release(backend: str) -> str:
    """``"major.minor"`` of the vLLM the trainer imports; ``ValueError`` naming it if unsupported."""
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    release = ".".join(version.split(".")[:2])
    if release not in SUPPORTED_VLLM_RELEASES:
        raise ValueError(
            f"backend {backend!r}: vllm {version} in the trainer is not supported; these adapters speak "
            f"the trainer API of vllm {' and '.join(SUPPORTED_VLLM_RELEASES)}. Install one of them (the "
            "release your servers run), or use backend 'torch_dist'"
        )
    return release


class _Passes:
    """The passes vLLM's engine takes over our source, so that a failed round
    can finish the pass the other trainer ranks are in."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self.current: Iterator[tuple[str, torch.Tensor]] | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.current = iter(self.source)
        return self.current

    def begin_round(self) -> None:
        self.current = None

    def finish_after_failure(self) -> None:
        """Run the gathers of this round that this rank has not run: the rest
        of the pass vLLM began (none if it ended, as when a finish was
        refused), or a whole pass if vLLM failed before iterating (a refused
        start). A fresh pass after a partial one would run more gathers than
        the other ranks, and their next collective would meet this rank's
        surplus gather instead."""
        pending, self.current = self.current, None
        drain(self.source if pending is None else pending)


def _as_vllm_source(source: _Passes, base: Any, release: str) -> Any:
    """Our source seen as the ``WeightSource`` of vLLM ``release`` (``base`` is
    its ``vllm.distributed.weight_transfer.base`` module).

    0.32: ``metadata()`` is a method and the engines iterate the source.
    0.33: ``metadata`` must be a ``functools.cached_property`` (checked when
    the subclass is defined) and the engines read ``iter_full()``. ``owners``
    stay unset: ``trainer_init`` checked the ownership these engines need
    (``_check_source``), and vLLM's checks of it then agree.
    """

    def metadata() -> list[Any]:
        return [base.ParamMeta(m.name, m.dtype, m.shape) for m in source_metadata(source.source)]

    if release == "0.32":

        class Source032(base.WeightSource):  # type: ignore[misc, name-defined]
            def metadata(self) -> list[Any]:
                return metadata()

            def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
                return iter(source)

        return Source032()

    class Source033(base.WeightSource):  # type: ignore[misc, name-defined]
        @functools.cached_property
        def metadata(self) -> list[Any]:
            return metadata()

        def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(source)

    return Source033()


class _VLLMNativeTrainerEngine(TrainerWeightTransferEngine[Any]):
    """Wraps one of vLLM's trainer engines; see the module docstring."""

    config_cls = VLLMNativeTrainerConfig
    backend: ClassVar[str]
    vllm_module: ClassVar[str]
    vllm_engine: ClassVar[str]
    vllm_init_info: ClassVar[str]

    def __init__(
        self, config: VLLMNativeTrainerConfig, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool,
        rank: int, inner: Any, passes: _Passes,
    ) -> None:  # fmt: skip
        super().__init__(config, client=client, source=source, is_sender=is_sender, rank=rank)
        self.inner = inner
        self._passes = passes

    @classmethod
    def trainer_init(
        cls,
        config: VLLMNativeTrainerConfig | Mapping[str, Any] | None = None,
        init_info: Any = None,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> _VLLMNativeTrainerEngine:
        """``(config, init_info)`` or, as released vLLM calls an engine,
        ``(init_info=...)`` alone; vLLM's own init info class is taken too.
        Settings the backend cannot honour are refused before vLLM is imported
        or a server called."""
        if init_info is None:
            raise TypeError(f"trainer_init() needs an init_info (a {cls.init_info_cls.__name__} or a dict)")
        config, init_info = cls.parse_settings(config, init_info)
        check_full_tensors(source, cls.backend)
        wire_source = source.with_wire_dtype(None if config.dtype is None else dtype_from_name(config.dtype))
        cls._check_source(config, init_info, source_metadata(wire_source))
        cls._check_client(client)
        module = _import_vllm(cls.backend, cls.vllm_module)
        base = _import_vllm(cls.backend, "vllm.distributed.weight_transfer.base")
        release = _vllm_release(cls.backend)
        vllm_info = getattr(module, cls.vllm_init_info)(**cls._vllm_init_kwargs(config, init_info, client))
        passes = _Passes(wire_source)
        inner = getattr(module, cls.vllm_engine).trainer_init(
            vllm_info, client=client, source=_as_vllm_source(passes, base, release)
        )
        return cls(
            config, client=client, source=wire_source, is_sender=init_info.is_sender, rank=init_info.rank,
            inner=inner, passes=passes,
        )  # fmt: skip

    @classmethod
    def parse_config(cls, config: Any) -> VLLMNativeTrainerConfig:
        # One config class serves both backends: a dict names this one.
        if config is None or isinstance(config, Mapping):
            config = {"backend": cls.backend, **(config or {})}
        return super().parse_config(config)

    @classmethod
    def _check_source(cls, config: VLLMNativeTrainerConfig, init_info: Any, metas: list[Any]) -> None:
        """Refuse a source vLLM's engine would fail on mid-round."""
        check_sender_owns_all(metas, cls.backend)

    @classmethod
    def _vllm_init_kwargs(cls, config: VLLMNativeTrainerConfig, init_info: Any, client: Any) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _check_client(cls, client: Any) -> None:
        """Refuse, before any call reaches a server, a client this backend cannot speak through."""

    def send_weights(self, weight_version: str | None = None) -> None:
        start = time.perf_counter()
        self._passes.begin_round()
        try:
            self.inner.send_weights()
        except BaseException:
            # vLLM's sender can fail before, during or after its pass over the
            # source (a refused start, a broken broadcast, a refused finish)
            # while the other ranks gather: finish the pass with them.
            self._passes.finish_after_failure()
            raise
        # vLLM's engines finish without a version; tag it afterwards.
        update_version = getattr(self.client, "update_weight_version", None)
        if self.is_sender and weight_version is not None and callable(update_version):
            update_version(weight_version)
        metas = source_metadata(self.source)
        self.last_stats = TransferStats(
            bytes=sum(m.nbytes for m in metas) if self.is_sender else 0,
            tensors=len(metas),
            seconds=time.perf_counter() - start,
        )

    def shutdown(self) -> None:
        self.inner.shutdown()


class NCCLTrainerWeightTransferEngine(_VLLMNativeTrainerEngine):
    """``nccl``: vLLM's dense NCCL broadcast (CUDA)."""

    init_info_cls = NCCLTrainerInitInfo
    backend = "nccl"
    vllm_module = "vllm.distributed.weight_transfer.nccl_engine"
    vllm_engine = "NCCLTrainerWeightTransferEngine"
    vllm_init_info = "NCCLTrainerInitInfo"

    @classmethod
    def _vllm_init_kwargs(cls, config: VLLMNativeTrainerConfig, init_info: NCCLTrainerInitInfo, client: Any) -> dict[str, Any]:
        world_size = init_info.world_size
        if world_size is None and init_info.rank == 0:
            world_size = group_world_size(client)
        return {
            "master_address": init_info.master_address,
            "master_port": init_info.master_port,
            "world_size": world_size or 0,  # unused on non-sender ranks
            "packed": config.packed,
            "packed_buffer_size_bytes": config.packed_buffer_size_bytes,
            "packed_num_buffers": config.packed_num_buffers,
            "rank": init_info.rank,
        }


class IPCTrainerWeightTransferEngine(_VLLMNativeTrainerEngine):
    """``ipc``: CUDA IPC handles to a server on the same GPUs (CUDA)."""

    init_info_cls = IPCTrainerInitInfo
    backend = "ipc"
    vllm_module = "vllm.distributed.weight_transfer.ipc_engine"
    vllm_engine = "IPCTrainerWeightTransferEngine"
    vllm_init_info = "IPCTrainerInitInfo"

    @classmethod
    def _check_source(cls, config: VLLMNativeTrainerConfig, init_info: IPCTrainerInitInfo, metas: list[Any]) -> None:
        """What vLLM's IPC engine cannot honour, refused before it starts a
        round: a tensor this rank does not own (every rank exports its own
        copies to its colocated worker), more than one pack buffer (it
        shares exactly one), and, packed, a tensor larger than that buffer
        (vLLM raises at that tensor, mid-round, the servers' update begun)."""
        for m in metas:
            if not m.owned_by(init_info.rank):
                raise ValueError(
                    f"{m.name!r} is owned by trainer ranks {list(m.owners or ())}, but backend 'ipc' needs every "
                    f"trainer rank to own every tensor (this is rank {init_info.rank})"
                )
        if config.packed_num_buffers != VLLM_PACKED_NUM_BUFFERS:
            raise ValueError(
                f"packed_num_buffers={config.packed_num_buffers}: backend 'ipc' packs into one shared buffer "
                "and has no packed_num_buffers; remove it"
            )
        if config.packed and metas:
            largest = max(metas, key=lambda m: m.nbytes)
            if largest.nbytes > config.packed_buffer_size_bytes:
                raise ValueError(
                    f"packed_buffer_size_bytes={config.packed_buffer_size_bytes} is below the largest tensor, "
                    f"{largest.name!r} ({largest.nbytes} bytes in {dtype_name(largest.dtype)}): backend 'ipc' packs "
                    f"into one buffer of that size; raise it to at least {largest.nbytes}, or set packed=False"
                )

    @classmethod
    def _check_client(cls, client: Any) -> None:
        # vLLM's own HTTP client pickles the IPC handles (torch classes and
        # dtypes) into the request, which its server unpickles only under
        # VLLM_ALLOW_INSECURE_SERIALIZATION=1; ours sends no pickle, so the
        # handles could not be encoded at the first update.
        if isinstance(client, HTTPVLLMWeightSyncClient):
            raise ValueError(
                "backend 'ipc' cannot send its CUDA IPC handles over HTTP (servers:) without pickling them; "
                "reach the server through Ray actors (ray_actors:), which carry the handles, or use "
                "backend 'nccl' or 'torch_dist'"
            )

    @classmethod
    def _vllm_init_kwargs(cls, config: VLLMNativeTrainerConfig, init_info: IPCTrainerInitInfo, client: Any) -> dict[str, Any]:
        return {
            "packed": config.packed,
            "packed_buffer_size_bytes": config.packed_buffer_size_bytes,
            "rank": init_info.rank,
        }
