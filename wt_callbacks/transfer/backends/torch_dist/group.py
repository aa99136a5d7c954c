"""The rendezvous store and the ``TransferGroup`` of ``torch_dist``.

The group is built without touching torch.distributed's global state (a
training job already has its own default group): trainer rank 0 runs a
``TCPStore`` master on ``master_address:master_port``; every inference worker
connects to it and joins a ``ProcessGroupGloo`` (CPU tensors) or
``ProcessGroupNCCL`` (CUDA tensors) under a ``PrefixStore``. Every wait is
bounded by ``timeout_s``: a dead peer raises, it never hangs.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from wt_callbacks.transfer.backends.torch_dist.shm_ring import ShmRing, join_ring, offer_ring
from wt_callbacks.transfer.base import WeightTransferError

logger = logging.getLogger(__name__)

_STORE_PREFIX = "wt_callbacks/torch_dist"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _local_address_towards(host: str) -> str:
    """The local IP the OS would use to reach ``host`` (gloo binds to it)."""
    if is_loopback(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP connect sends nothing; it only picks a route
        return s.getsockname()[0]


def open_store(
    master_address: str, master_port: int, world_size: int, *, is_master: bool, timeout_s: float
) -> dist.TCPStore:
    """Rendezvous store; the master binds ``master_address:master_port``."""
    try:
        return dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=is_master,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:
        if is_master:
            raise WeightTransferError(
                f"cannot listen on master_address={master_address!r} master_port={master_port}: {e}. "
                "Pick a free port (or 0 for any free port) and an address of this machine that the "
                "servers can reach"
            ) from e
        raise WeightTransferError(
            f"cannot reach the trainer's rendezvous store at {master_address}:{master_port} "
            f"within {timeout_s:g} s: {e}"
        ) from e


class TransferGroup:
    """The trainer plus inference workers: one stateless process group.

    ``broadcast`` is asynchronous and returns a work handle; rank 0 is always
    the source. ``destroy`` aborts the group so a peer stuck in a collective
    with us gets an error right away instead of waiting for its timeout.
    ``transport`` says what broadcasts travel over: ``"gloo"``, ``"nccl"``
    or ``"shm"`` (the ring ``shm``; the gloo group is still there).
    """

    def __init__(self, store: dist.Store, pg: Any, rank: int, world_size: int, device: torch.device,
                 shm: ShmRing | None = None) -> None:  # fmt: skip
        self.store = store
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.shm = shm
        self.transport = "shm" if shm is not None else "nccl" if device.type == "cuda" else "gloo"

    @classmethod
    def connect(
        cls,
        store: dist.Store,
        *,
        master_address: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        transport: str,
        device: torch.device,
        fallback_to_gloo: bool = False,
    ) -> TransferGroup:
        """Join the group (blocks until every rank joined, at most ``timeout_s``).

        ``transport="shm"`` then negotiates the ring (``shm_ring``);
        ``fallback_to_gloo`` matters on rank 0 only, which decides for every
        rank: when a rank cannot map the ring, use gloo broadcasts (``True``,
        what ``auto`` asks for) or fail naming the fix.
        """
        prefix = dist.PrefixStore(_STORE_PREFIX, store)
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if transport == "nccl":
                # Untested here (no GPU): the CPU build of torch has no NCCL.
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
            else:
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address_towards(master_address))]
                pg = dist.ProcessGroupGloo(prefix, rank, world_size, opts)
        except (RuntimeError, OSError) as e:
            raise WeightTransferError(
                f"the transfer group of world_size={world_size} did not form within timeout_s={timeout_s:g} "
                f"(this is rank {rank}): {e}. world_size must be 1 + all inference workers of all servers"
            ) from e
        if transport != "shm":
            return cls(store, pg, rank, world_size, device)
        try:
            if rank == 0:
                shm = offer_ring(prefix, world_size=world_size, timeout_s=timeout_s, fallback_to_gloo=fallback_to_gloo)
            else:
                shm = join_ring(prefix, rank=rank, world_size=world_size, timeout_s=timeout_s)
        except BaseException as e:
            cls(store, pg, rank, world_size, device).destroy()
            if isinstance(e, WeightTransferError) or not isinstance(e, Exception):
                raise
            raise WeightTransferError(
                f"the shared-memory ring negotiation did not finish within timeout_s={timeout_s:g} "
                f"(this is rank {rank}; did a rank die?): {e}"
            ) from e
        return cls(store, pg, rank, world_size, device, shm)

    def broadcast(self, tensor: torch.Tensor) -> Any:
        if self.shm is not None:
            return self.shm.broadcast(tensor)
        return self.pg.broadcast(tensor, 0)

    @property
    def broadcast_parts(self) -> Callable[[list[torch.Tensor]], Any] | None:
        """Broadcast several tensors as one message (what the receivers get is
        their concatenation), or None when the transport cannot: only the
        ring can, and it lets the sender skip the pack copy."""
        return self.shm.broadcast_parts if self.shm is not None else None

    def destroy(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        try:
            self.pg.abort()
        except Exception:  # noqa: BLE001 - best effort: the peer may already be gone
            logger.debug("abort of the transfer group failed", exc_info=True)
        self.pg = None
        self.store = None
