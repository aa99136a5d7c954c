"""Who can take part in a weight transfer, against the reference receiver.

The control plane is guarded by the server's token (``--api-key`` /
``VLLM_API_KEY``); the data plane by the session secret the trainer sends
over it (``torch_dist.session``). The attackers are real processes
(``tests.support.attacker``); each prints what it tried and what it got,
and the test checks that and that the trainer's next round still works.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from tests.support import REPO_ROOT
from tests.support.transfer import LOCAL, TIMEOUT_S, connect
from wt_callbacks.checksums import module_checksums
from wt_callbacks.demos import models
from wt_callbacks.demos.multiprocess import free_port
from wt_callbacks.demos.receiver_process import receiver_checksums
from wt_callbacks.transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightSyncHTTPError,
    WeightTransferError,
    WeightTransferTrainerFactory,
)
from wt_callbacks.transfer.backends.torch_dist.session import session_proof, store_prefix

pytestmark = pytest.mark.slow

KEY = "s3cret-token"
GUARDED = [
    ("POST", "init_weight_transfer_engine", {"init_info": {}}),
    ("POST", "start_weight_update", None),
    ("POST", "update_weights", {"update_info": {}}),
    ("POST", "finish_weight_update", None),
    ("POST", "shutdown_weight_transfer_engine", None),
    ("POST", "pause", None),
    ("POST", "resume", None),
    ("GET", "weight_checksums", None),
    ("GET", "weight_info", None),
    ("GET", "get_world_size", None),
    ("POST", "collective_rpc", {"method": "reload_weights"}),
]


def attack(*args: str) -> dict[str, Any]:
    """Run the attacker process to the end; its report."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.attacker", *args], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def shift(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)


@pytest.mark.parametrize("how", ["--api-key", "VLLM_API_KEY"])
def test_receiver_requires_its_token_on_every_route_but_health(receiver_proc, how):
    if how == "--api-key":
        receiver = receiver_proc(extra_args=("--api-key", KEY))
    else:
        receiver = receiver_proc(env={"VLLM_API_KEY": KEY})
    for token in (None, "wrong"):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        for method, route, body in GUARDED:
            answer = requests.request(method, f"{receiver.url}/{route}", json=body, headers=headers, timeout=10)
            assert answer.status_code == 401, (route, answer.text)
            assert "--api-key or VLLM_API_KEY" in answer.json()["error"]["message"]
    assert requests.get(f"{receiver.url}/health", timeout=10).status_code == 200

    model = models.tiny_mlp(seed=0)
    with pytest.raises(WeightSyncHTTPError, match="HTTP 401: the server refused the token: pass api_key= or set VLLM_API_KEY"):
        connect(receiver.url, ModuleSource(model))
    client, engine = connect(receiver.url, ModuleSource(model), api_key=KEY)
    try:
        engine.send_weights("with-token")
        assert client.weight_info()[0]["weight_version"] == "with-token"
    finally:
        engine.shutdown()
    headers = {"Authorization": f"Bearer {KEY}"}
    held = requests.get(f"{receiver.url}/weight_checksums", headers=headers, timeout=10).json()["checksums"]
    assert held == module_checksums(model)


def test_the_token_is_proven_to_the_worker_engine_never_replayed(receiver_proc):
    """Past the HTTP guard, the engine itself wants proof of the token for
    this session and this rendezvous: a trainer without it (an older one,
    which knows the token but sends no proof) and a replayed proof are refused,
    and the live session stays."""
    receiver = receiver_proc(extra_args=("--api-key", KEY))
    model = models.tiny_mlp(seed=0)
    client, engine = connect(receiver.url, ModuleSource(model), api_key=KEY)
    try:
        engine.send_weights("v1")
        info = dict(engine.worker_init_info)
        no_proof = {k: v for k, v in info.items() if k not in ("session_id", "session_proof")}
        replayed = {**info, "master_port": free_port()}
        for init_info, expected in ((no_proof, "carries no session_proof"), (replayed, "does not match")):
            with pytest.raises(WeightSyncHTTPError, match=f"init_weight_transfer_engine refused: .*{expected}.*VLLM_API_KEY"):
                client.init_weight_transfer_engine(init_info)
        assert info["session_proof"] == session_proof(KEY, info["session_id"], "127.0.0.1", info["master_port"])
        shift(model)
        engine.send_weights("v2")  # the same engine: its session outlived both refusals
    finally:
        engine.shutdown()
    held = requests.get(f"{receiver.url}/weight_checksums", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert held.json()["checksums"] == module_checksums(model)


def test_an_init_whose_group_does_not_form_leaves_the_live_session(receiver_proc):
    """An init naming a port where no trainer listens fails before joining
    anything: the live session keeps delivering. A trainer whose group forms
    takes the server over; the previous session is over then."""
    receiver = receiver_proc()
    model = models.tiny_mlp(seed=0)
    client, engine = connect(receiver.url, ModuleSource(model), transport="gloo")
    try:
        engine.send_weights("v1")
        closed = {**engine.worker_init_info, "master_port": free_port(), "timeout_s": 5}
        with pytest.raises(WeightSyncHTTPError, match=r"cannot reach the trainer's rendezvous store at 127.0.0.1:\d+"):
            client.init_weight_transfer_engine(closed)
        shift(model)
        engine.send_weights("v2")  # the same engine: its session outlived the failed init
        _, successor = connect(receiver.url, ModuleSource(model), transport="gloo")
        try:
            shift(model)
            successor.send_weights("v3")
            start = time.monotonic()
            with pytest.raises(WeightTransferError, match="for another weight-transfer session"):
                engine.send_weights("v4")
            assert time.monotonic() - start < TIMEOUT_S / 2
        finally:
            successor.shutdown()
    finally:
        engine.shutdown()
    assert receiver_checksums(receiver.url) == module_checksums(model)
    assert client.weight_info()[0]["version_history"] == ["v1", "v2", "v3"]


def test_a_stranger_on_the_control_plane_cannot_break_or_take_over_the_session(receiver_proc):
    """A receiver without a token (anyone reaches its routes); a stranger
    calls them between the trainer's rounds: a malformed init, the lifecycle
    out of order, updates the model or the session does not have. Every call
    is refused at once, naming what is wrong, and the trainer's next round,
    on the same engine (its session), delivers."""
    receiver = receiver_proc()
    model = models.tiny_mlp(seed=0)
    client, engine = connect(receiver.url, ModuleSource(model), transport="gloo")
    try:
        engine.send_weights("v1")
        metas = engine.source.metadata()
        report = attack("control-plane", receiver.url, "--names", json.dumps([m.name for m in metas]),
                        "--shapes", json.dumps([list(m.shape) for m in metas]))  # fmt: skip
        print(json.dumps(report, indent=1))
        calls = {c["call"]: c for c in report["calls"]}
        assert "world_size must be >= 2" in calls["init"]["answer"], calls["init"]
        check_refusals(report, TIMEOUT_S / 2)
        shift(model)
        engine.send_weights("v2")
    finally:
        engine.shutdown()
    assert receiver_checksums(receiver.url) == module_checksums(model)
    assert client.weight_info()[0]["version_history"] == ["v1", "v2"]


REFUSED = {
    "update before start": "start_weight_update must be called before update_weights",
    "finish before start": "without an active weight update",
    "second start": "already active",
    "update: unknown name": "for another weight-transfer session",
    "update: wrong shape": "for another weight-transfer session",
    "update: bad dtype": "dtype_names",
    "update: a name twice": "twice (at 0 and 1)",
    "update: another session": "for another weight-transfer session",
    "update: no session": "for another weight-transfer session",
    "finish": "without an active weight update",
}
"""What each of the attacker's calls must get (a substring of the answer; the
status is an error for all of them): vLLM's words for lifecycle misuse, the
key to fix for the rest."""


def check_refusals(report: dict[str, Any], within_s: float, messages: dict[str, str] = REFUSED) -> None:
    """Every call of the control-plane attacker but its starts was refused, at
    once (nothing was received), with the message that names what is wrong."""
    for call in report["calls"]:
        if call["call"] == "start":
            assert call["status"] == 200, call
            continue
        if call["call"] not in messages:
            continue
        assert call["status"] >= 400, call
        assert messages[call["call"]] in call["answer"], call
        assert call["seconds"] < within_s, call


class _HoldInit:
    """A client whose ``init_weight_transfer_engine`` first lets ``before``
    run with the init_info, and forwards it only if ``forward``."""

    def __init__(self, inner: HTTPVLLMWeightSyncClient, before: Any, forward: bool) -> None:
        self.inner, self.before, self.forward = inner, before, forward

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.before(init_info)
        if self.forward:
            self.inner.init_weight_transfer_engine(init_info)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _wait_for(path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"the attacker never got ready ({path})"
        time.sleep(0.02)


def test_a_process_that_knows_only_the_master_port_cannot_join(receiver_proc, tmp_path):
    """The attacker connects to the trainer's store first and waits to join
    as rank 1 under the store prefix trainers used before sessions; the
    server joins after it. The group forms without the attacker, the round
    delivers, the attacker times out having read nothing."""
    receiver = receiver_proc()
    port = free_port()
    ready = tmp_path / "ready"
    report: dict[str, Any] = {}
    attacker = threading.Thread(target=lambda: report.update(
        attack("store", "127.0.0.1", str(port), "--ready", str(ready), "--seconds", "5")))  # fmt: skip
    attacker.start()
    model = models.tiny_mlp(seed=0)
    client = _HoldInit(HTTPVLLMWeightSyncClient(receiver.url, timeout=TIMEOUT_S), lambda _: _wait_for(ready), forward=True)
    engine = WeightTransferTrainerFactory.trainer_init(
        "torch_dist", {"timeout_s": TIMEOUT_S, "transport": "gloo"}, {**LOCAL, "master_port": port},
        client=client, source=ModuleSource(model),
    )  # fmt: skip
    try:
        engine.send_weights("legit")
    finally:
        engine.shutdown()
    attacker.join(timeout=60)
    print(json.dumps(report, indent=1))
    assert report["store"] == "connected"
    assert not any(report["keys_seen"].values()), report
    assert report["joined"] is False and report["bytes_read"] == report["weights_read"] == 0, report
    assert receiver_checksums(receiver.url) == module_checksums(model)


def test_a_process_that_got_into_the_group_without_the_secret_reads_no_weights(receiver_proc, tmp_path):
    """Worse: the attacker sniffed the store's traffic (so it knows the
    session's key prefix, not its secret) and takes the server's place as
    rank 1 before the server joins. The session check catches it: the
    rendezvous fails naming it, and nothing but the check's challenge and
    digests ever reached it."""
    receiver = receiver_proc()
    port = free_port()
    ready = tmp_path / "ready"
    report: dict[str, Any] = {}

    def impostor(init_info: dict[str, Any]) -> None:
        # What a sniffer of the store's port sees: the key prefix.
        prefix = store_prefix(init_info["session_id"])
        threading.Thread(target=lambda: report.update(attack(
            "store", "127.0.0.1", str(port), "--prefix", prefix, "--ready", str(ready), "--seconds", "5"))).start()  # fmt: skip
        _wait_for(ready)

    model = models.tiny_mlp(seed=0)
    client = _HoldInit(HTTPVLLMWeightSyncClient(receiver.url, timeout=TIMEOUT_S), impostor, forward=False)
    with pytest.raises(WeightTransferError, match=r"a process that does not hold the session secret took a worker's place \(rank\(s\) \[1\]\)"):
        WeightTransferTrainerFactory.trainer_init(
            "torch_dist", {"timeout_s": TIMEOUT_S, "transport": "gloo"}, {**LOCAL, "master_port": port},
            client=client, source=ModuleSource(model),
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while "joined" not in report or ("read_error" not in report and "join_error" not in report):
        assert time.monotonic() < deadline, report
        time.sleep(0.05)
    print(json.dumps(report, indent=1))
    assert report["joined"] is True and report["verdict"] == 0, report
    assert report["weights_read"] == 0, report
    assert receiver_checksums(receiver.url) != module_checksums(model)
