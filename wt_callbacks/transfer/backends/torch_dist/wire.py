"""The wire format of ``torch_dist``: the typed configs and the dicts trainer and workers exchange.

The dicts are those of vLLM's dense ``nccl`` backend (worker init_info
``master_address, master_port, rank_offset, world_size, packed,
packed_buffer_size_bytes, packed_num_buffers``; update_info ``names,
dtype_names, shapes``) plus ``timeout_s`` and ``transport`` (``"gloo"``,
``"nccl"`` or ``"shm"``) and the session's keys (``session_id``,
``session_proof``: see ``session``) and, when off, ``all_or_nothing``, and
in the update dict ``staged`` when on, so moving to stock vLLM later is a
config change.
Dtype names are torch attribute names (``"bfloat16"``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from wt_callbacks.transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    WeightTransferConfig,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    dtype_from_name,
    dtype_name,
)
from wt_callbacks.transfer.infos import VLLM_PACKED_BUFFER_SIZE_BYTES, VLLM_PACKED_NUM_BUFFERS
from wt_callbacks.transfer.validation import check_niceness, check_positive, check_wire_fields, parse_wire_dtype

BACKEND = "torch_dist"
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 64 * 1024 * 1024
"""The backend config's default: 64 MiB chunks. Smaller chunks pipeline better
(the receiver loads chunk k while chunk k+1 is on the wire) and bound memory
lower; on this CPU box 64 MiB was as fast as 256 MiB to the reference
receiver and faster into vLLM (see benchmarks/). The init info keeps vLLM's
1 GiB default, in force when the init info alone is given (released vLLM's
``trainer_init(init_info, ...)``)."""
DEFAULT_PACKED_NUM_BUFFERS = VLLM_PACKED_NUM_BUFFERS
DEFAULT_TIMEOUT_S = 300.0
TRANSPORTS = ("auto", "gloo", "nccl", "shm")
WORKER_TRANSPORTS = ("gloo", "nccl", "shm")
MAX_WORLD_SIZE = 2**31 - 1
"""The largest group torch.distributed's C++ side (a 32-bit int) can form."""


@dataclass
class TorchDistTrainerConfig(WeightTransferConfig):
    """Trainer-side settings of the ``torch_dist`` backend.

    ``packed``, ``packed_buffer_size_bytes`` and ``packed_num_buffers`` are
    also fields of ``TorchDistTrainerInitInfo``, where released vLLM keeps
    them; a value set in one is used (set in both, differently, refused at
    ``trainer_init``; in neither, the defaults here).

    Attributes:
        packed: broadcast many tensors per collective (recommended); ``False``
            sends one collective per tensor.
        packed_buffer_size_bytes: target chunk size: a chunk closes after the
            tensor that reaches it, so a tensor larger than it travels as a
            chunk of its own (as in vLLM's packed broadcast).
        packed_num_buffers: buffers rotated while packing (2 = pack the next
            chunk while the previous one is on the wire).
        dtype: wire dtype name for floating-point parameters (``"bfloat16"``);
            ``None`` sends each parameter in its own dtype. The cast happens
            before any FSDP gather.
        timeout_s: bound on every wait (rendezvous, each broadcast, each
            server call); also sent to the workers.
        transport: ``"auto"`` (NCCL when the trainer has CUDA; else
            ``"shm"`` with a fallback to gloo when ``master_address`` is a
            loopback address; else gloo), ``"gloo"``, ``"nccl"`` or
            ``"shm"`` (gloo group, broadcasts through a ring in ``/dev/shm``;
            every server must run on this host and share its ``/dev/shm``,
            or the rendezvous fails naming the fix). How the ranks agree on
            the ring, and the fallback: see ``shm_negotiation``.
        reuse_buffers: keep the packing buffers between rounds (host memory
            only; on a GPU the caching allocator reuses freed blocks anyway).
            Fresh host memory is page-faulted on first touch, which costs more
            than the copy into it; keeping them costs the ``packed_num_buffers``
            buffers of memory while the trainer is not syncing.
        all_or_nothing: a vLLM server writes an update's new weights into
            the served model only once every tensor of it arrived, so a round
            cut mid-stream keeps all the previous weights (the default).
            ``False`` is vLLM's own layerwise reload: each layer is processed
            as its last tensor arrives, overlapping vLLM's processing with the
            receive and (unpacked, or over nccl) freeing each layer's received
            tensors at once, but a cut round leaves the layers it completed
            new and serves a mix once resumed. Choose it when a server cannot hold a second copy of the
            model in the wire dtype (``transport="nccl"`` or ``packed=False``,
            where the received tensors otherwise stay until the update ends).
            The reference receiver is all or nothing either way.
    """

    backend: str = BACKEND
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    dtype: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    transport: str = "auto"
    reuse_buffers: bool = True
    all_or_nothing: bool = True

    def __post_init__(self) -> None:
        if self.backend != BACKEND:
            raise ValueError(f"backend must be {BACKEND!r} for this config, got {self.backend!r}")
        check_wire_fields(self)
        check_positive("timeout_s", self.timeout_s)
        if self.dtype is not None:
            parse_wire_dtype(self.dtype)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of {TRANSPORTS}")

    @property
    def wire_dtype(self) -> torch.dtype | None:
        return None if self.dtype is None else parse_wire_dtype(self.dtype)


@dataclass
class TorchDistTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of ``torch_dist``: the shape of vLLM's
    ``NCCLTrainerInitInfo`` (the same fields, positions and wire meaning;
    defaults where vLLM's has none), so code written for it runs with this
    class in its place.

    Attributes:
        master_address: address the trainer (rank 0) listens on and the
            workers connect to; it must be reachable from the servers.
            ``None`` (the default; vLLM's has none): the address this host
            reaches the servers from, loopback when they all run on this
            host (``addresses``: the client's ``server_hosts()`` says where
            they run), so the servers' URLs are all a trainer on another
            host needs.
        master_port: port for the rendezvous store; ``0`` (the default;
            vLLM's has none) picks a free one.
        world_size: 1 + all inference workers; when omitted, the sender asks
            the client (``get_world_size()``) and adds 1.
        packed: broadcast packed chunks (vLLM's default) or one tensor per
            collective; sent to the workers, which unpack the same way.
        packed_buffer_size_bytes: the chunk size both sides cut the stream
            at (vLLM's default: 1 GiB).
        packed_num_buffers: buffers rotated on both sides (vLLM's default: 2).
        rank: keyword-only, this process's trainer rank; rank 0 is the sender.

    The packing fields are the backend config's too (``TorchDistTrainerConfig``).
    """

    backend: ClassVar[str] = BACKEND  # the factory dispatches on it
    master_address: str | None = None
    master_port: int = 0
    world_size: int | None = None
    packed: bool = True
    packed_buffer_size_bytes: int = VLLM_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = VLLM_PACKED_NUM_BUFFERS

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in 0..65535, got {self.master_port}")
        if self.world_size is not None and self.world_size < 2:
            raise ValueError(
                f"world_size must be >= 2 (the trainer plus at least one worker), got {self.world_size}"
            )
        check_wire_fields(self)


@dataclass(kw_only=True)
class TorchDistWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker-side init dict (vLLM's dense NCCL keys + ``timeout_s``, ``transport``,
    ``session_id``, ``session_proof``).

    ``transport``: ``"gloo"``, ``"nccl"`` or ``"shm"`` (the gloo group, then
    the ring's negotiation: see ``shm_negotiation``). ``session_id``: the session's
    secret; ``session_proof``: proof of the server's token (both in
    ``session``). Both optional: a trainer older than sessions sends neither,
    and a server without a token then accepts it as before.
    ``all_or_nothing``: see ``TorchDistTrainerConfig``; a trainer sends it only
    when ``False``, so servers older than the key keep taking the default
    (and refuse ``False``, naming the unknown key, rather than ignore it).
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = VLLM_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = VLLM_PACKED_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S
    transport: str = "gloo"
    session_id: str | None = None
    session_proof: str | None = None
    all_or_nothing: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.rank_offset < MAX_WORLD_SIZE:
            raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer), got {self.rank_offset}")
        if not 2 <= self.world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be >= 2 (and <= {MAX_WORLD_SIZE}), got {self.world_size}")
        check_positive("packed_buffer_size_bytes", self.packed_buffer_size_bytes, integer=True)
        check_positive("packed_num_buffers", self.packed_num_buffers, integer=True)
        check_positive("timeout_s", self.timeout_s)
        if self.transport not in WORKER_TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of {WORKER_TRANSPORTS}")


@dataclass
class TorchDistWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per-round update dict: the tensors that follow on the wire, in order,
    and the ``session_id`` of the session they belong to (see ``session``).

    ``lora``: set when the tensors are a LoRA adapter, not model weights
    (``wt_callbacks.lora``): ``{"name", "version", "config"}``, the name it is
    served under, its version in the session and its ``adapter_config.json``.
    The worker writes it as that version (``lora.files``) instead of loading
    it into the model.

    ``staged`` (``commit: staged``): the worker accepts the update (every
    check that refuses one before any byte moves runs first), receives it on
    a thread of its own into staging that the served model does not read,
    and returns, so the server keeps generating on its previous weights while
    the round streams; ``finish_weight_update`` waits for the staging and
    applies it, or discards it if the staging failed or the trainer left the
    group meanwhile. A trainer sends the key only when it is true, so a server
    older than it refuses a staged round (naming the key) instead of taking
    it as a plain one.

    ``prepared`` (``commit: prepared``, with ``staged``): the worker also
    brings the round into the form it serves (its loaders and its post-load
    processing, into a second copy of the layers the round loads) before
    the trainer pauses it, so the commit only copies that in. Sent only when
    true, so a server older than the key refuses such a round, naming it.

    ``staging_nice`` (0-19, with ``staged``): the niceness the worker's
    staging thread runs at, at least (the server's ``WT_STAGING_NICE`` is
    the floor), so generation gets the cores before a round the trainer
    does not wait for (``SyncConfig.staging_nice``). Sent only when above 0.

    ``keep`` (``{"names", "dtype_names", "shapes"}``, as the sent tensors are
    described): checkpoint tensors this round does not send, which the server
    keeps as it holds them (frozen base tensors a trainer sent in an earlier
    round of the session, ``SyncConfig.send_frozen``). A round is then
    complete when the sent and the kept tensors together are the checkpoint;
    a server refuses one that keeps part of what it loads as one unit (a
    kept ``k_proj`` beside a sent ``q_proj``, fused into one vLLM layer)
    before any byte moves. Sent only when not empty, so a server older than
    the key refuses such a round (naming it) instead of finding it incomplete.
    """

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    session_id: str | None = None
    lora: dict[str, Any] | None = None
    staged: bool = False
    prepared: bool = False
    staging_nice: int = 0
    keep: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.dtypes = _described(self.names, self.dtype_names, self.shapes, key="")
        if self.prepared and not self.staged:
            raise ValueError("prepared: true needs staged: true (a prepared round is a staged one, processed before its commit)")
        check_niceness("staging_nice", self.staging_nice)
        if self.staging_nice and not self.staged:
            raise ValueError("staging_nice applies to a staged round (its staging thread): it needs staged: true")
        self.kept_names: list[str] = []
        self.kept_dtypes: list[torch.dtype] = []
        self.kept_shapes: list[list[int]] = []
        if self.keep is not None:
            if not isinstance(self.keep, dict) or set(self.keep) != {"names", "dtype_names", "shapes"}:
                raise ValueError('keep must be {"names": [...], "dtype_names": [...], "shapes": [...]}')
            self.kept_names, self.kept_shapes = list(self.keep["names"]), list(self.keep["shapes"])
            self.kept_dtypes = _described(self.kept_names, self.keep["dtype_names"], self.kept_shapes, key="keep.")
            both = sorted(set(self.names) & set(self.kept_names))
            if both:
                raise ValueError(f"keep.names lists {both[0]!r}, which names sends: a tensor is sent or kept, not both")
            if self.lora is not None:
                raise ValueError("keep applies to model weights; a LoRA adapter round (lora) sends the adapter whole")
        if self.lora is not None:
            from wt_callbacks.lora.files import check_component

            if set(self.lora) != {"name", "version", "config"} or not isinstance(self.lora["config"], dict):
                raise ValueError("lora must be {\"name\": str, \"version\": str, \"config\": {...}}")
            check_component("lora.name", self.lora["name"])
            check_component("lora.version", self.lora["version"])


def _described(names: Any, dtype_names: Any, shapes: Any, *, key: str) -> list[torch.dtype]:
    """Check one description of tensors (``names``, ``dtype_names``,
    ``shapes``; ``key`` the prefix of their keys in the update dict) and
    return their dtypes."""
    if not all(isinstance(v, (list, tuple)) for v in (names, dtype_names, shapes)):
        raise ValueError(f"{key}names, {key}dtype_names and {key}shapes must be lists")
    if not len(names) == len(dtype_names) == len(shapes):
        raise ValueError(
            f"{key}names, {key}dtype_names and {key}shapes must have equal lengths, got "
            f"{len(names)}, {len(dtype_names)}, {len(shapes)}"
        )
    for i, name in enumerate(names):
        if not isinstance(name, str):
            raise ValueError(f"{key}names[{i}] must be a tensor name (a string), got {name!r}")
    check_names_unique(names, key=f"{key}names")
    dtypes = [dtype_from_name(n, key=f"{key}dtype_names[{i}]") for i, n in enumerate(dtype_names)]
    for i, shape in enumerate(shapes):
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{key}shapes[{i}] ({names[i]}) must be a list of non-negative ints, got {shape!r}")
    return dtypes


def check_names_unique(names: Iterable[str], *, key: str) -> None:
    """Refuse a round that names a tensor twice (``ValueError`` naming it).

    vLLM's layerwise reload counts a layer's received elements: a tensor
    sent twice makes its layer look complete before the layer's other
    tensors arrived, or loads it twice. A weight source that lists a name
    twice is a bug to report before anything moves, not a round to deliver.
    """
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        j = first.setdefault(name, i)
        if j != i:
            raise ValueError(f"{key} lists {name!r} twice (at {j} and {i}); a round sends each tensor once")


def _description(metas: Iterable[ParamMeta]) -> dict[str, Any]:
    metas = list(metas)
    return {
        "names": [m.name for m in metas],
        "dtype_names": [dtype_name(m.dtype) for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def update_info_for(
    metas: Iterable[ParamMeta],
    *,
    session_id: str | None = None,
    staged: bool = False,
    prepared: bool = False,
    staging_nice: int = 0,
    kept: Iterable[ParamMeta] = (),
) -> dict[str, Any]:
    """The JSON update dict describing ``metas``, for the session ``session_id``
    (an engine's ``session_id``; ``None`` for a group formed without one);
    ``staged`` asks for a staged round (``prepared``: one the servers
    also process before the commit; ``staging_nice``: the niceness they
    stage it at, at least), ``kept`` describes the tensors the
    servers keep as they hold them (``TorchDistWeightTransferUpdateInfo``)."""
    info = _description(metas)
    if session_id is not None:
        info["session_id"] = session_id
    if staged:
        info["staged"] = True
    if prepared:
        info["prepared"] = True
    if staging_nice:
        info["staging_nice"] = staging_nice
    kept = list(kept)
    if kept:
        info["keep"] = _description(kept)
    return info
