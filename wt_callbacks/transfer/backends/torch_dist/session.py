"""The session of ``torch_dist``: its secret, the proof of the server's token, the peer check.

A session is one rendezvous of a trainer with its servers and every round
until the group is torn down. The trainer draws a random ``session_id`` for
each; it is a secret, like a web session id: it travels to the servers only
inside ``init_weight_transfer_engine``'s init_info and each round's
update_info, over the control plane, which the server's bearer token guards.
Everything on the data plane is bound to it:

* the rendezvous store's keys live under a prefix derived from it
  (``store_prefix``), so a process that only knows ``master_port`` finds
  none of them: it can neither join the group nor learn the ring's path
  (the ``shm`` negotiation runs in the same prefixed store);
* once the group formed, every worker proves it holds the secret
  (``check_peers``) before a byte of weights moves, so a process that got
  into the group some other way (racing a worker to the trainer's gloo
  listener) is caught, and the rendezvous fails instead of leaking;
* every update_info carries it, and a worker refuses an update of another
  session before receiving anything.

The server's token (``VLLM_API_KEY``, what vLLM's ``--api-key`` reads) is
proven, never sent: the trainer puts ``session_proof`` = HMAC-SHA256(key,
session id + rendezvous address) in the init_info, so a replayed init_info
cannot point the server at another rendezvous. Servers without a token
accept any init_info, and an init_info without ``session_id`` (a trainer
older than sessions) gets the store prefix such trainers used.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

import torch

from wt_callbacks.transfer.auth import API_KEY_ENV
from wt_callbacks.transfer.base import WeightTransferError

LEGACY_STORE_PREFIX = "wt_callbacks/torch_dist"
"""The store prefix of sessions without a ``session_id``."""
_DIGEST_BYTES = 32


def new_session_id() -> str:
    """A fresh 256-bit session secret, hex."""
    return secrets.token_hex(_DIGEST_BYTES)


def store_prefix(session_id: str | None) -> str:
    """The rendezvous store prefix of a session.

    A one-way function of the secret, so the keys (which a process on the
    store's port could wait on) never spell the secret itself.
    """
    if session_id is None:
        return LEGACY_STORE_PREFIX
    return f"{LEGACY_STORE_PREFIX}/{hashlib.sha256(('store:' + session_id).encode()).hexdigest()}"


def session_proof(api_key: str, session_id: str, master_address: str, master_port: int) -> str:
    """What proves to a server that the trainer holds its token, for one session and rendezvous."""
    message = f"wt_callbacks/torch_dist/init\n{session_id}\n{master_address}\n{master_port}"
    return hmac.new(api_key.encode(), message.encode(), hashlib.sha256).hexdigest()


def check_init_authorized(
    api_key: str | None, session_id: str | None, proof: str | None, master_address: str, master_port: int
) -> None:
    """Refuse an init_info that does not prove the server's token (when it has one).

    ``PermissionError`` names the settings on both sides; nothing else happens.
    """
    if api_key is None:
        return
    fix = (
        f"this server requires its token ({API_KEY_ENV} in the server's environment) for "
        f"init_weight_transfer_engine: give the trainer the same key (api_key: in the weight_sync "
        f"config, HTTPVLLMWeightSyncClient(api_key=...), or {API_KEY_ENV} in the trainer's environment)"
    )
    if session_id is None or proof is None:
        raise PermissionError(f"init_weight_transfer_engine refused: the init_info carries no session_proof; {fix}")
    expected = session_proof(api_key, session_id, master_address, master_port)
    if not hmac.compare_digest(expected, proof):
        raise PermissionError(
            f"init_weight_transfer_engine refused: session_proof does not match this server's token; {fix}"
        )


def check_update_session(active: str | None, received: str | None) -> None:
    """Refuse an update_info that is not for the active session (``PermissionError``)."""
    if active is None and received is None:
        return
    if active is None or received is None or not hmac.compare_digest(active, received):
        raise PermissionError(
            "update_weights refused before receiving anything: its update_info is for another weight-transfer "
            "session (session_id missing or different from the active one's). The active session is kept"
        )


def _peer_digest(session_id: str, challenge: bytes, rank: int) -> bytes:
    return hmac.new(session_id.encode(), challenge + rank.to_bytes(4, "big"), hashlib.sha256).digest()


def check_peers(pg: Any, *, session_id: str, rank: int, world_size: int, device: torch.device) -> None:
    """Every rank proves it holds the session secret, before any weights move.

    Rank 0 broadcasts a random challenge; every rank all-gathers its
    HMAC(secret, challenge, rank); rank 0 checks them and broadcasts the
    verdict. A process that got into the group without the secret cannot
    answer, learns only the challenge and the digests (which reveal nothing
    of the secret), and the group is refused on every rank.
    """
    challenge = torch.zeros(_DIGEST_BYTES, dtype=torch.uint8, device=device)
    if rank == 0:
        challenge.copy_(torch.frombuffer(bytearray(secrets.token_bytes(_DIGEST_BYTES)), dtype=torch.uint8))
    pg.broadcast(challenge, 0).wait()
    nonce = bytes(challenge.cpu().tolist())
    mine = torch.frombuffer(bytearray(_peer_digest(session_id, nonce, rank)), dtype=torch.uint8).to(device)
    answers = [torch.empty_like(mine) for _ in range(world_size)]
    pg.allgather([answers], [mine]).wait()
    verdict = torch.ones(1, dtype=torch.uint8, device=device)
    if rank == 0:
        impostors = [
            r for r in range(1, world_size)
            if not hmac.compare_digest(bytes(answers[r].cpu().tolist()), _peer_digest(session_id, nonce, r))
        ]  # fmt: skip
        verdict.fill_(0 if impostors else 1)
    pg.broadcast(verdict, 0).wait()
    if not int(verdict.item()):
        raise WeightTransferError(
            "the transfer group was refused: a process that does not hold the session secret took a "
            + (f"worker's place (rank(s) {impostors}). " if rank == 0 else "worker's place. ")
            + "Nothing was sent; check who else can reach master_address:master_port and the ranks' ports"
        )
