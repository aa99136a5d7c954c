"""The trainer's side of forming a ``torch_dist`` group with the servers' workers.

Rank 0 of the trainer picks the address the workers reach it at and the
transport, opens the rendezvous store, and then, at once, asks the servers to
join (``init_weight_transfer_engine``, on one thread) and joins itself (on
another): each side's join waits for the other, so neither may wait first.
Everything it starts is bounded by the config's ``timeout_s`` and torn down if
it gives up, so a server that never answers cannot leave a store, a port or a
half-formed group behind.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from wt_callbacks.transfer.backends.torch_dist.addresses import advertised_address, is_loopback
from wt_callbacks.transfer.backends.torch_dist.group import TransferGroup, open_store, wait_at_exit
from wt_callbacks.transfer.backends.torch_dist.session import new_session_id, session_proof
from wt_callbacks.transfer.backends.torch_dist.waits import raise_if_failed
from wt_callbacks.transfer.backends.torch_dist.wire import TorchDistTrainerConfig, TorchDistTrainerInitInfo
from wt_callbacks.transfer.base import VLLMWeightSyncClient, WeightTransferError, bounded, in_daemon_thread
from wt_callbacks.transfer.server_group import group_world_size

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rendezvous:
    """A formed group: the group, what the workers were sent to join it, and its session."""

    group: TransferGroup
    worker_init_info: dict[str, Any]
    session_id: str


def choose_transport(config: TorchDistTrainerConfig, master_address: str, *, host_snapshot: bool) -> str:
    """The transport the group uses: the configured one, or for ``auto`` the
    fastest this trainer can honour towards where its servers run.

    ``host_snapshot``: the source's bytes lie in host memory (``send: async``),
    so NCCL is never picked for it: its communicator must not run beside the
    training's own.
    """
    if config.transport == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "transport='nccl' needs CUDA on the trainer, and this process has no CUDA device; use "
            "transport 'auto' (the shm ring to this host's servers, gloo to others) or 'gloo'"
        )
    if config.transport != "auto":
        return config.transport
    if torch.cuda.is_available() and not host_snapshot:
        return "nccl"
    # A loopback master means every server runs on this host (loopback
    # towards another host is refused: ``addresses``), so the ring is worth
    # offering; the negotiation still checks each worker shares this /dev/shm
    # (a container may not). A trainer on another host than a server never
    # offers it.
    return "shm" if is_loopback(master_address) else "gloo"


def master_address_for(client: VLLMWeightSyncClient, given: str | None, *, timeout_s: float) -> str:
    """The address the workers reach this trainer at: ``given``, or the one
    this host reaches the servers from (``addresses``), asked from the
    client's ``server_hosts()`` where it has one."""
    server_hosts = getattr(client, "server_hosts", None)
    hosts = None
    if callable(server_hosts):
        hosts = bounded(server_hosts, "server_hosts", within_s=timeout_s)
    address = advertised_address(hosts, given)
    if given is None and not is_loopback(address):
        logger.info(
            "torch_dist: advertising %s, this host's address towards the servers on %s", address, ", ".join(hosts or ())
        )
    return address


def rendezvous(
    client: VLLMWeightSyncClient,
    config: TorchDistTrainerConfig,
    init_info: TorchDistTrainerInitInfo,
    *,
    host_snapshot: bool,
) -> Rendezvous:
    """Form the group with every worker of ``client``'s servers (see the module
    docstring); raises ``WeightTransferError`` when it is not formed within
    the config's ``timeout_s``, with nothing of it left running."""
    timeout_s = config.timeout_s
    master_address = master_address_for(client, init_info.master_address, timeout_s=timeout_s)
    transport = choose_transport(config, master_address, host_snapshot=host_snapshot)
    world_size = bounded(lambda: group_world_size(client, init_info.world_size), "get_world_size", within_s=timeout_s)
    device = torch.device("cuda", torch.cuda.current_device()) if transport == "nccl" else torch.device("cpu")
    master = open_store(master_address, init_info.master_port, world_size, is_master=True, timeout_s=timeout_s)
    port = master.port
    session_id = new_session_id()
    worker_init_info: dict[str, Any] = {
        "master_address": master_address,
        "master_port": port,
        "rank_offset": 1,
        "world_size": world_size,
        "packed": config.packed,
        "packed_buffer_size_bytes": config.packed_buffer_size_bytes,
        "packed_num_buffers": config.packed_num_buffers,
        "timeout_s": timeout_s,
        "transport": transport,
        "session_id": session_id,
    }
    if not config.all_or_nothing:
        worker_init_info["all_or_nothing"] = False
    # The client holds the servers' token; a server that has one checks this
    # proof of it (``session``).
    api_key = getattr(client, "api_key", None)
    if api_key:
        worker_init_info["session_proof"] = session_proof(api_key, session_id, master_address, port)
    payload = dict(worker_init_info)
    # The group joins through a client of the store, not the store server
    # itself: giving up, this thread closes the server, which ends a join
    # still waiting for workers at once (left to run out its timeout, it holds
    # the port, and a process exiting meanwhile aborts in it). The client
    # connects here, while the server surely listens: connecting on the join's
    # thread, it could find the server already closed by a fast failure below,
    # and TCPStore then retries its connect in C++ for twice timeout_s, past
    # any exit wait.
    store = open_store(master_address, port, world_size, is_master=False, timeout_s=timeout_s)
    server_call = in_daemon_thread(lambda: client.init_weight_transfer_engine(payload), "wt-init")
    joined = in_daemon_thread(
        lambda: TransferGroup.connect(
            store,
            master_address=master_address,
            rank=0,
            world_size=world_size,
            timeout_s=timeout_s,
            transport=transport,
            device=device,
            session_id=session_id,
            fallback_to_gloo=config.transport == "auto",
        ),
        "wt-rendezvous",
    )
    try:
        # The join may take timeout_s for the group and again for the ring.
        deadline = time.monotonic() + 2 * timeout_s + 5
        while not (joined.done() and server_call.done()):
            raise_if_failed(server_call, "init_weight_transfer_engine")
            if joined.done() and joined.exception() is not None:
                raise joined.exception()
            if time.monotonic() > deadline:
                raise WeightTransferError(f"rendezvous with the servers did not finish within timeout_s={timeout_s:g}")
            time.sleep(0.01)
        raise_if_failed(server_call, "init_weight_transfer_engine")
    except BaseException:
        # A group the join still forms after we gave up has no owner: it would
        # keep its ring and heartbeat alive for good.
        joined.add_done_callback(lambda f: f.exception() is None and f.result().destroy())
        # Closing the store ends a join still waiting for it at once; the
        # join's thread is then on its way out of gloo's C++ code, and a
        # process that exits now (this error, uncaught) waits for it.
        del master
        wait_at_exit(joined, 2 * timeout_s + 5)
        raise
    group = joined.result()
    group.keep_store_server(master)
    logger.info("torch_dist: %s group of %d ranks formed on %s:%d", group.transport, world_size, master_address, port)
    return Rendezvous(group=group, worker_init_info=worker_init_info, session_id=session_id)
