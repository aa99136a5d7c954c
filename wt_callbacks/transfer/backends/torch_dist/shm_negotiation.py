"""Whether a transfer group streams through the ``shm`` ring: the negotiation over the store.

The ring rides on a formed ``torch_dist`` gloo group (``TransferGroup.connect``):
rank 0 creates and maps the file and offers it through the rendezvous store
(``offer_ring``); its path and layout travel there, not in the init dict,
since they exist only once the group is forming. Every worker maps it and
reports (``join_ring``); rank 0 unlinks the file and decides for every rank:
the ring is used (every rank mapped it), broadcasts fall back to gloo (a rank
could not, and the trainer asked for ``auto``), or the group fails naming the
fix (it asked for ``shm``). Workers are told ``transport="shm"`` in both
cases, so they follow the decision rather than know the trainer's setting.
"""

from __future__ import annotations

import datetime
import json
import logging
import secrets

import torch.distributed as dist

from wt_callbacks.transfer.backends.torch_dist.shm_files import SHM_DIR, create_ring_file, map_ring_file, unlink_ring
from wt_callbacks.transfer.backends.torch_dist.shm_ring import SHM_SLOT_BYTES, SHM_SLOTS, ShmRing
from wt_callbacks.transfer.backends.torch_dist.trainer_process import TrainerProcess
from wt_callbacks.transfer.backends.torch_dist.waits import trainer_store_call
from wt_callbacks.transfer.base import WeightTransferError

logger = logging.getLogger(__name__)


def _shm_unavailable(detail: str) -> str:
    return (
        f"transport='shm' needs a shared-memory ring in {SHM_DIR} that the trainer creates and every "
        f"inference worker maps, but {detail}. Run the servers on the trainer's host, as the same user "
        f"and sharing its {SHM_DIR} (a container needs --ipc=host or a shared {SHM_DIR} mount), or set "
        "transport='gloo' (or 'auto', which falls back to gloo)"
    )


def offer_ring(store: dist.Store, *, world_size: int, timeout_s: float, fallback_to_gloo: bool) -> ShmRing | None:
    """Rank 0 of the negotiation: create and map the ring, publish it, collect
    every worker's report, unlink the file, decide for every rank."""
    nbytes = ShmRing.file_bytes(world_size, SHM_SLOTS, SHM_SLOT_BYTES)
    ring, path, problems = None, "", {}
    try:
        path = create_ring_file(nbytes)
        ring = ShmRing(map_ring_file(path, nbytes), rank=0, world_size=world_size, slots=SHM_SLOTS,
                       slot_bytes=SHM_SLOT_BYTES, timeout_s=timeout_s)  # fmt: skip
    except (OSError, RuntimeError) as e:
        problems[0] = f"the trainer cannot create it: {type(e).__name__}: {e}"
    try:
        offer = {
            "path": path if ring is not None else "", "slots": SHM_SLOTS, "slot_bytes": SHM_SLOT_BYTES,
            "trainer": TrainerProcess.identity(),
        }  # fmt: skip
        store.set("shm/ring", json.dumps(offer))
        if ring is not None:
            keys = [f"shm/mapped/{r}" for r in range(1, world_size)]
            try:
                store.wait(keys, datetime.timedelta(seconds=timeout_s))
            except BaseException:
                # A worker that never reported hung or died: tell the others
                # at once rather than leave them waiting for a decision.
                store.set("shm/decision", json.dumps({"use": "error", "message": "a worker never reported"}))
                ring.close()
                raise
            for r, key in enumerate(keys, start=1):
                report = store.get(key).decode()
                if not report.startswith("hello "):
                    problems[r] = f"rank {r} cannot: {report}"
                elif ring.hello(r) != int(report.split()[1]):
                    # The path opened, but a different file: not this memory.
                    problems[r] = f"rank {r} mapped a different file of that name (its own {SHM_DIR}?)"
    finally:
        if path:
            # Every rank mapped the file or gave up: from here on it lives only
            # as long as the mappings, so even a crash leaks nothing.
            unlink_ring(path)
    decision = {"use": "shm", "message": ""}
    if problems:
        detail = "; ".join(problems[r] for r in sorted(problems))
        if fallback_to_gloo:
            decision["use"] = "gloo"
            logger.warning("torch_dist: shared-memory ring unavailable (%s); every rank uses gloo broadcasts", detail)
        else:
            decision = {"use": "error", "message": _shm_unavailable(detail)}
    store.set("shm/decision", json.dumps(decision))
    return _follow(decision, ring)


def join_ring(store: dist.Store, *, rank: int, world_size: int, timeout_s: float) -> ShmRing | None:
    """A worker's side of the negotiation: map the offered ring, report, follow rank 0's decision.

    Its ``get``s wait on the trainer's store, which a frozen trainer never
    answers: bounded (``waits``). ``set`` does not wait for an answer."""
    offer = json.loads(trainer_store_call(lambda: store.get("shm/ring"), "the ring's offer", timeout_s=timeout_s))
    ring = None
    if offer["path"]:
        try:
            nbytes = ShmRing.file_bytes(world_size, offer["slots"], offer["slot_bytes"])
            ring = ShmRing(map_ring_file(offer["path"], nbytes), rank=rank, world_size=world_size,
                           slots=offer["slots"], slot_bytes=offer["slot_bytes"], timeout_s=timeout_s,
                           trainer=TrainerProcess.checkable(offer.get("trainer")))  # fmt: skip
            nonce = secrets.randbits(62) + 1
            ring.write_hello(nonce)
            report = f"hello {nonce}"
        except Exception as e:  # noqa: BLE001 - every failure is reported: rank 0 waits for a report
            ring = None
            report = f"{offer['path']}: {type(e).__name__}: {e}"
        store.set(f"shm/mapped/{rank}", report)
    decision = trainer_store_call(lambda: store.get("shm/decision"), "the ring's decision", timeout_s=timeout_s)
    return _follow(json.loads(decision), ring)


def _follow(decision: dict[str, str], ring: ShmRing | None) -> ShmRing | None:
    if decision["use"] == "error":
        raise WeightTransferError(decision["message"])
    if decision["use"] == "gloo":
        return None
    assert ring is not None, "rank 0 decided for the ring only if every rank mapped it"
    ring.start()
    return ring
