"""``python -m tests.support.attacker``: a process that was not invited tries to take part.

``control-plane URL``: calls the weight routes as a stranger would (no token,
or a wrong one): an init (pointed at its own rendezvous with ``--hijack``,
else malformed), the lifecycle out of order, and updates with an unknown
name, a name listed twice, a wrong shape, a bad dtype, another session's id
and no session. ``store HOST PORT``: knows only ``master_port`` and tries to
join the transfer group through the rendezvous store, with the store prefix
a trainer without sessions used, or one sniffed off the store's traffic
(``--prefix``); if it gets in, it plays the session check with a guessed
secret and reads what it can. Either way it prints what it tried and what it
got, one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import secrets
import time
from pathlib import Path
from typing import Any

import requests

from wt_callbacks.transfer.backends.torch_dist.session import LEGACY_STORE_PREFIX


def control_plane(url: str, token: str | None, names: list[str], shapes: list[list[int]], hijack: bool) -> dict[str, Any]:
    """Every kind of request the worker must refuse before a byte moves, each
    after a ``start`` where it needs one (a refused update ends the update)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # A valid init pointing the server at the attacker's own rendezvous, or
    # (``hijack`` off: a server without a token takes any valid one) a malformed one.
    init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2 if hijack else 1}

    def update(**changes: Any) -> dict[str, Any]:
        info = {"names": list(names), "dtype_names": ["float32"] * len(names), "shapes": [list(s) for s in shapes]}
        return {"update_info": {**info, **changes}}

    start = ("start", "POST", "start_weight_update", None)
    calls = [
        ("init", "POST", "init_weight_transfer_engine", {"init_info": init}),
        ("update before start", "POST", "update_weights", update()),
        ("finish before start", "POST", "finish_weight_update", None),
        start,
        ("second start", "POST", "start_weight_update", None),
        ("update: unknown name", "POST", "update_weights", update(names=["no.such.weight", *names[1:]])),
        start,
        ("update: wrong shape", "POST", "update_weights", update(shapes=[[d + 1 for d in s] for s in shapes])),
        start,
        ("update: bad dtype", "POST", "update_weights", update(dtype_names=["float99"] * len(names))),
        start,
        ("update: a name twice", "POST", "update_weights", update(names=[names[0], *names[:-1]])),
        start,
        ("update: another session", "POST", "update_weights", update(session_id="0" * 64)),
        start,
        ("update: no session", "POST", "update_weights", update()),
        ("finish", "POST", "finish_weight_update", None),
    ]
    report = []
    for label, method, route, body in calls:
        begin = time.monotonic()
        answer = requests.request(method, f"{url}/{route}", json=body, headers=headers, timeout=60)
        try:
            message = answer.json()
            message = message.get("error", message)
            message = message.get("message", message) if isinstance(message, dict) else message
        except ValueError:
            message = answer.text
        report.append({"call": label, "request": f"{method} /{route}", "status": answer.status_code,
                       "seconds": round(time.monotonic() - begin, 3), "answer": str(message)[:300]})  # fmt: skip
    return {"calls": report}


def store(host: str, port: int, prefix: str, ready: Path, world_size: int, seconds: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    report: dict[str, Any] = {"prefix": prefix, "store": None, "joined": False, "bytes_read": 0, "weights_read": 0}
    deadline = time.monotonic() + 60
    while True:
        try:
            tcp = dist.TCPStore(host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=seconds))
            report["store"] = "connected"
            break
        except Exception as e:  # noqa: BLE001 - the trainer has not opened it yet
            if time.monotonic() > deadline:
                report["store"] = f"never reachable: {e}"
                return report
            time.sleep(0.02)
    view = dist.PrefixStore(prefix, tcp)
    report["keys_seen"] = {key: view.check([key]) for key in ("0", "1", "shm/ring", "shm/decision", "trainer_left")}
    ready.write_text("ready")
    try:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=seconds)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(view, world_size - 1, world_size, opts)
        report["joined"] = True
    except Exception as e:  # noqa: BLE001 - reported
        report["join_error"] = str(e).splitlines()[0][:200]
        return report
    try:
        # The session check, played with a guessed secret.
        challenge = torch.zeros(32, dtype=torch.uint8)
        pg.broadcast(challenge, 0).wait()
        answers = [torch.empty(32, dtype=torch.uint8) for _ in range(world_size)]
        pg.allgather([answers], [torch.frombuffer(bytearray(secrets.token_bytes(32)), dtype=torch.uint8)]).wait()
        verdict = torch.zeros(1, dtype=torch.uint8)
        pg.broadcast(verdict, 0).wait()
        report["bytes_read"] = 32 + 32 * world_size + 1
        report["verdict"] = int(verdict.item())
        while True:  # then whatever the trainer broadcasts next: the weights
            chunk = torch.empty(4096, dtype=torch.uint8)
            pg.broadcast(chunk, 0).wait()
            report["weights_read"] += 4096
    except Exception as e:  # noqa: BLE001 - reported
        report["read_error"] = str(e).splitlines()[0][:200]
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="target", required=True)
    cp = sub.add_parser("control-plane")
    cp.add_argument("url")
    cp.add_argument("--token")
    cp.add_argument("--names", required=True, help="JSON list")
    cp.add_argument("--shapes", required=True, help="JSON list of lists")
    cp.add_argument("--hijack", action="store_true")
    st = sub.add_parser("store")
    st.add_argument("host")
    st.add_argument("port", type=int)
    st.add_argument("--prefix", default=LEGACY_STORE_PREFIX)
    st.add_argument("--ready", type=Path, required=True, help="file written once it waits to join")
    st.add_argument("--world-size", type=int, default=2)
    st.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    if args.target == "control-plane":
        report = control_plane(args.url, args.token, json.loads(args.names), json.loads(args.shapes), args.hijack)
    else:
        report = store(args.host, args.port, args.prefix, args.ready, args.world_size, args.seconds)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
