"""The fault matrix against the reference receiver: every phase of a round, every fault.

Phases: connect (rendezvous), pause, start, mid-stream of ``update_weights``
(packed and unpacked, gloo and shm), finish, resume. Server faults: process
killed (SIGKILL), frozen (SIGSTOP: its sockets stay open and nothing
answers, then SIGCONT), HTTP 500 answered (a proxy in front of it), and
connection refused while it restarts. Trainer faults: rank > 0 killed
mid-gather and rank 0 killed mid-stream (2-rank FSDP2); a trainer frozen
(SIGSTOP: its store and sockets stay open and nothing answers) mid-stream
and while a server joins its group.

Each server-fault cell runs twice at once, against two receivers: with
``on_error="raise"`` the round raises within ``RAISE_BOUND_S`` of the fault;
with ``"warn"`` it returns ``None`` as fast, and the first round once the
server is back (same URL) delivers equal checksums. In both, the server
never holds a half-applied round: its checksums are the old ones, or (when
the fault hit at finish or later, after every tensor arrived) all new ones.
The detection times are printed as a table at the end. CI runs a covering
subset; ``WT_FAULT_MATRIX=full`` runs every cell.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
import torch.distributed as dist

from tests.support import REPO_ROOT
from tests.support.faults import FULL_MATRIX, FaultProxy, FaultTable, FaultyClient, ReceiverForks, fault_round
from tests.support.transfer import InterruptingSource, wait_until_update_began
from wt_callbacks.checksums import module_checksums
from wt_callbacks.config import SyncConfig
from wt_callbacks.demos import models
from wt_callbacks.demos.multiprocess import free_port
from wt_callbacks.demos.receiver_process import receiver_checksums
from wt_callbacks.sync import Collectives, WeightSync
from wt_callbacks.transfer import HTTPVLLMWeightSyncClient, WeightTransferError
from wt_callbacks.transfer.backends.torch_dist.session import new_session_id
from wt_callbacks.transfer.backends.torch_dist.waits import STORE_SLACK_S
from wt_callbacks.transfer.base import CLEANUP_TIMEOUT_S, in_daemon_thread

# Every test here also fails if it leaves a ring file of ours behind.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_ring_left_behind")]

TIMEOUT_S = 3.0
"""``timeout_s`` of every trainer here: small, so a hang costs seconds."""
LOAD_SLACK_S = 5.0
"""What a bound here allows past its waits, for a loaded machine."""
RAISE_BOUND_S = TIMEOUT_S + 2 * min(TIMEOUT_S, CLEANUP_TIMEOUT_S) + LOAD_SLACK_S
"""A failed round ends within ``timeout_s`` (detection) + the two bounded
best-effort calls after it (finish, resume) + 5 s for a loaded machine (a
frozen server takes all three waits: 9.0-9.4 s of the 14 here)."""
CLIENT_TIMEOUT_S = 120.0
"""The cells' clients wait this long for an answer: ``timeout_s`` must bound
every server call whatever timeout the client it was given has."""
FACTORY = "wt_callbacks.demos.models:many_tensors"
RECEIVING = "torch_dist update_weights: receiving"
"""What the receiver's worker engine logs when an accepted update begins to stream."""
ROUTES = {
    "connect": "init_weight_transfer_engine",
    "pause": "pause",
    "start": "start_weight_update",
    "finish": "finish_weight_update",
    "resume": "resume",
}
MID_STREAM = {
    "mid-stream packed gloo": {"transport": "gloo", "packed": True},
    "mid-stream unpacked gloo": {"transport": "gloo", "packed": False},
    "mid-stream packed shm": {"transport": "shm", "packed": True},
    "mid-stream unpacked shm": {"transport": "shm", "packed": False},
}
# ``WT_FAULT_MATRIX=full`` runs every cell. Otherwise (CI) a frozen server, which costs
# ``timeout_s`` plus the clean-up per cell, is tried once per kind of wait
# (rendezvous, a gloo broadcast, the ring, an HTTP call: finish stands for
# pause, start and resume, whose calls wait the same way), and an HTTP 500 on
# the calls that end a round differently; kills cost milliseconds and run in
# every phase.
CELLS = (
    [("kill", phase) for phase in [*ROUTES, *MID_STREAM]]
    + [("freeze", phase) for phase in [*ROUTES, *MID_STREAM]
       if FULL_MATRIX or phase in ("connect", "finish", "mid-stream packed gloo", "mid-stream packed shm")]
    + [("5xx", phase) for phase in ROUTES if FULL_MATRIX or phase in ("connect", "start", "finish")]
    + [("5xx", "mid-stream packed gloo"), ("5xx", "mid-stream packed shm")]
)  # fmt: skip
# What the server may hold after a fault in this phase: a round whose every
# tensor arrived (finish, resume) may have been applied, or not; never part of it.
MAY_HOLD_NEW = ("finish", "resume")


@pytest.fixture(scope="module")
def forks(tmp_path_factory) -> Iterator[ReceiverForks]:
    forks = ReceiverForks(tmp_path_factory.mktemp("receivers"))
    yield forks
    forks.close()


@pytest.fixture(scope="module")
def table(request) -> Iterator[FaultTable]:
    table = FaultTable()
    yield table
    table.print(request.config, f"fault matrix, reference receiver (timeout_s={TIMEOUT_S:g}, bound {RAISE_BOUND_S:g} s)")


def weight_sync(url: str, client: Any, on_error: str, **config: Any) -> WeightSync:
    cfg = SyncConfig(
        servers=[url], timeout_s=TIMEOUT_S, on_error=on_error, config={"packed_buffer_size_bytes": 4096, **config}
    )
    return WeightSync(cfg, client=client)


def assert_next_trainer_delivers(receiver: Any, model: torch.nn.Module, **config: Any) -> None:
    """A fresh trainer's first round into ``receiver`` (after a fault) arrives bitwise."""
    ws = weight_sync(receiver.url, None, "raise", **config)
    try:
        ws.setup(model)
        assert ws.sync(0) is not None
    finally:
        ws.close()
    assert receiver.checksums() == module_checksums(model)


def run_cell(forks: ReceiverForks, fault: str, phase: str, on_error: str) -> tuple[float, str]:
    """One fault in one phase under one ``on_error``; returns (detection seconds, outcome)."""
    receiver = forks.start(FACTORY)
    proxy = FaultProxy(receiver.url) if fault == "5xx" else None
    url = proxy.url if proxy is not None else receiver.url
    before = receiver.checksums()
    model = models.many_tensors(seed=0)
    client = FaultyClient(HTTPVLLMWeightSyncClient(url, timeout=CLIENT_TIMEOUT_S))
    ws = weight_sync(url, client, on_error, **MID_STREAM.get(phase, {}))
    route = ROUTES.get(phase, "update_weights")
    strike: Callable[[], None] = {
        "kill": receiver.kill, "freeze": receiver.freeze, "5xx": lambda: proxy.fail_next(route),
    }[fault]  # fmt: skip
    try:
        detected, outcome = fault_round(
            ws, client, model, fault=fault, phase=phase, strike=strike, mid_stream=phase in MID_STREAM and fault != "5xx",
            route=route, after=30, on_error=on_error, bound_s=RAISE_BOUND_S,
        )  # fmt: skip

        if fault == "freeze":
            receiver.thaw()
        elif fault == "kill" and on_error == "warn":
            receiver.restart()
        if fault != "kill" or on_error == "warn":
            # Answers once the server worked off what reached it while it was down.
            held = receiver.checksums()
            allowed = [before, module_checksums(model)] if phase in MAY_HOLD_NEW else [before]
            assert held in allowed, f"{fault} at {phase}: the server holds part of a round"
            outcome += ", held old" if held == before else ", held new (every tensor had arrived)"
        if on_error == "warn":
            result = ws.sync(2)
            assert result is not None, f"{fault} at {phase}: the first round after the server came back failed"
            assert receiver.checksums() == module_checksums(model)
            assert HTTPVLLMWeightSyncClient(url).is_paused() == [False]
            outcome += ", next round delivered"
        return detected, outcome
    finally:
        ws.close()
        if proxy is not None:
            proxy.close()
        receiver.kill()


@pytest.mark.parametrize(("fault", "phase"), CELLS, ids=[f"{f}-{p.replace(' ', '-')}" for f, p in CELLS])
def test_server_fault(forks, table, fault, phase):
    results: dict[str, tuple[float, str] | BaseException] = {}

    def run(on_error: str) -> None:
        try:
            results[on_error] = run_cell(forks, fault, phase, on_error)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            results[on_error] = e

    # raise and warn at once, each against its own receiver: one cell costs one fault's time.
    threads = [threading.Thread(target=run, args=(mode,)) for mode in ("raise", "warn")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for mode in ("raise", "warn"):
        result = results.get(mode, AssertionError(f"the {mode} run did not finish within 120 s"))
        if isinstance(result, BaseException):
            raise result
        table.add(f"{fault} @ {phase}", mode, *result)


def test_connection_refused_while_the_server_restarts(forks, table):
    """A server that is down answers nothing at all: every round fails at once
    (no timeout), and the first round once it is back delivers."""
    receiver = forks.start(FACTORY)
    model = models.many_tensors(seed=0)
    ws = weight_sync(receiver.url, None, "warn")
    try:
        ws.setup(model)
        assert ws.sync(1) is not None
        receiver.kill()
        for step in (2, 3):  # the round drops the engine; the next one's reconnect is refused too
            start = time.monotonic()
            assert ws.sync(step) is None
            table.add("refused @ restart", "warn", time.monotonic() - start, f"round {step} warned at once")
            assert time.monotonic() - start < TIMEOUT_S
        receiver.restart()
        assert ws.sync(4) is not None
        assert receiver.checksums() == module_checksums(model)
    finally:
        ws.close()
    start = time.monotonic()
    with pytest.raises(WeightTransferError, match="cannot reach the server"):
        receiver.kill()
        weight_sync(receiver.url, None, "raise").setup(model)
    table.add("refused @ restart", "raise", time.monotonic() - start, "raised: cannot reach the server")
    assert time.monotonic() - start < TIMEOUT_S


def test_an_update_a_dead_round_left_open_does_not_block_the_next_trainer(forks, table):
    """A trainer that died (or whose clean-up finish was lost while the server
    was frozen) between start and update leaves the server paused and
    "already active": nothing on the server ends either (vLLM has no lease on
    a pause). The next trainer finishes that update (it holds nothing), its
    round delivers, and its resume ends the pause."""
    receiver = forks.start(FACTORY)
    before = receiver.checksums()
    dead_round = HTTPVLLMWeightSyncClient(receiver.url, timeout=TIMEOUT_S)
    dead_round.pause()
    dead_round.start_weight_update()
    model = models.many_tensors(seed=3)
    ws = weight_sync(receiver.url, None, "raise")
    try:
        ws.setup(model)
        start = time.monotonic()
        assert ws.sync(1) is not None
        table.add("left open by a dead round @ start", "raise", time.monotonic() - start, "finished it, round delivered")
    finally:
        ws.close()
    assert before != module_checksums(model) and receiver.checksums() == module_checksums(model)
    assert dead_round.is_paused() == [False]
    dead_round.close()
    receiver.kill()


# --------------------------------------------------------------------------- #
# trainer faults: a 2-rank FSDP2 trainer loses a rank in the middle of a round
# --------------------------------------------------------------------------- #


def _trainer_rank(
    rank: int, pg_port: int, url: str, server_log: str, out_dir: str, victim: int, transport: str, model_name: str
) -> None:
    """Rank ``victim`` SIGKILLs itself in the middle of the second round; the
    other rank reports when it raised and when the receiver resumed."""
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=2)
    model = getattr(models, model_name)(seed=0)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    cfg = SyncConfig(servers=[url], timeout_s=TIMEOUT_S, config={"transport": transport, "packed_buffer_size_bytes": 4096})
    ws = WeightSync(cfg)
    ws.setup(model, rank, 2, collectives=Collectives.from_torch_distributed())
    assert ws.sync(0) is not None
    out = Path(out_dir)
    (out / f"rank{rank}-round0").write_text(json.dumps(module_checksums(model)))  # a collective: before the kill

    def die() -> None:
        if rank == 0:  # "mid-stream": the server began this second round
            wait_until_update_began(server_log, RECEIVING, rounds=2)
        (out / "death").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == victim:
        # rank 0: after the third tensor went out; rank 1: between two gathers.
        ws.engine.source = InterruptingSource(ws.engine.source, die, after=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    report: dict[str, Any] = {}
    try:
        ws.sync(1)
        report["error"] = None
    except WeightTransferError as e:
        report.update(error=str(e), raised_after_s=time.time() - float((out / "death").read_text()))
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    # The group lost a rank: tearing it down could hang on the dead peer.
    os._exit(0)


@contextmanager
def serving_again(url: str, death_file: Path, deadline_s: float) -> Iterator[dict[str, float]]:
    """Watches the receiver from this process: seconds from the trainer's
    death until it no longer is paused (its round with the dead trainer
    ended). The watch ends with the block, before its receiver is killed."""
    found: dict[str, float] = {}
    done = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + deadline_s
        while not death_file.exists() and time.monotonic() < deadline and not done.wait(0.01):
            pass
        while time.monotonic() < deadline and not done.is_set():
            if death_file.exists() and death_file.read_text() and not requests.get(f"{url}/is_paused", timeout=5).json()["is_paused"]:
                found["seconds"] = time.time() - float(death_file.read_text())
                return
            done.wait(0.02)

    watcher = threading.Thread(target=watch, name="watch-receiver", daemon=True)
    watcher.start()
    try:
        yield found
    finally:
        done.set()
        watcher.join(timeout=10)


TRAINER_CELLS = [(1, "gloo"), (0, "gloo")] + ([(0, "shm")] if FULL_MATRIX else [])
"""A rank's death costs two spawned trainer processes: the ring's own abort
path (rank 0 killed over shm) runs with the full matrix."""


@pytest.mark.parametrize(
    ("victim", "transport"), TRAINER_CELLS,
    ids=[f"rank{v}-killed-mid-{'gather' if v else 'stream-' + t}" for v, t in TRAINER_CELLS],
)  # fmt: skip
def test_trainer_rank_killed(forks, table, tmp_path, victim, transport):
    # FSDP2 gathers in 4 MiB buckets: only a model of several buckets has
    # gathers left to run when rank 1 dies after its third tensor.
    model_name = "wide_mlp" if victim else "tiny_mlp"
    receiver = forks.start(f"wt_callbacks.demos.models:{model_name}")
    with serving_again(receiver.url, tmp_path / "death", deadline_s=240) as serving:
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        ranks = [
            ctx.Process(
                target=_trainer_rank,
                args=(r, port, receiver.url, str(receiver.log_path), str(tmp_path), victim, transport, model_name),
            )
            for r in range(2)
        ]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(timeout=180)
        for p in ranks:
            if p.is_alive():
                p.kill()
        survivor = 1 - victim
        assert ranks[victim].exitcode == -signal.SIGKILL
        assert ranks[survivor].exitcode == 0, f"the surviving rank exited with {ranks[survivor].exitcode}"
        report = json.loads((tmp_path / f"rank{survivor}.json").read_text())
        assert report["error"] is not None, "the surviving rank did not raise"
        assert report["raised_after_s"] < RAISE_BOUND_S, report
        # The server left the dead trainer's round (old weights) and resumed
        # generation: on its own when rank 0 died, by rank 0's cleanup otherwise.
        deadline = time.monotonic() + 10
        while "seconds" not in serving and time.monotonic() < deadline:
            time.sleep(0.05)
    assert serving.get("seconds", float("inf")) < (RAISE_BOUND_S if victim else TIMEOUT_S), serving
    assert receiver.checksums() == json.loads((tmp_path / f"rank{survivor}-round0").read_text())
    cell = f"trainer rank {victim} killed ({'mid-gather' if victim else 'mid-stream ' + transport})"
    table.add(cell, "raise", report["raised_after_s"],
              f"rank {survivor} raised; server held old, serving after {serving['seconds']:.2f}s")  # fmt: skip
    # The restarted trainer's first round delivers.
    assert_next_trainer_delivers(receiver, getattr(models, model_name)(seed=5), transport=transport)
    receiver.kill()


def _frozen_trainer(url: str, server_log: str, out_dir: str, transport: str) -> None:
    """A trainer whose second round stops mid-stream: it says so, then waits
    for the test to freeze it (SIGSTOP) and kill it (SIGKILL)."""
    torch.set_num_threads(1)
    model = models.many_tensors(seed=0)
    ws = weight_sync(url, None, "raise", transport=transport)
    ws.setup(model)
    assert ws.sync(0) is not None
    out = Path(out_dir)

    def stall() -> None:
        wait_until_update_began(server_log, RECEIVING, rounds=2)  # the server receives round 2
        (out / "stalled").write_text("")
        time.sleep(120)

    ws.engine.source = InterruptingSource(ws.engine.source, stall, after=30)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ws.sync(1)


FROZEN_TRAINER_CELLS = ["gloo", "shm"]


@pytest.mark.parametrize("transport", FROZEN_TRAINER_CELLS, ids=[f"trainer-frozen-mid-stream-{t}" for t in FROZEN_TRAINER_CELLS])
def test_trainer_frozen_mid_stream(forks, table, tmp_path, transport):
    """A frozen trainer (SIGSTOP: a hung process, a host whose network
    dropped without closing its connections) answers nothing, its store
    included. The receiver's update fails at the group's ``timeout_s``, it
    holds the old weights and serves again (its weight lock is free: the
    checksums answer), and the next trainer's round into it delivers."""
    receiver = forks.start(FACTORY)
    trainer = multiprocessing.get_context("spawn").Process(
        target=_frozen_trainer, args=(receiver.url, str(receiver.log_path), str(tmp_path), transport)
    )
    trainer.start()
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "stalled").exists():
            assert trainer.is_alive() and time.monotonic() < deadline, "the trainer never reached its second round"
            time.sleep(0.02)
        os.kill(trainer.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        bound_s = TIMEOUT_S + LOAD_SLACK_S
        while True:  # the checksums take the receiver's weight lock, which update_weights holds
            try:
                held = receiver_checksums(receiver.url, timeout_s=1.0)
                break
            except requests.Timeout:
                assert time.monotonic() - frozen_at < bound_s, (
                    f"the receiver still blocked {time.monotonic() - frozen_at:.1f} s after its trainer froze "
                    f"(timeout_s={TIMEOUT_S:g})"
                )
        freed_s = time.monotonic() - frozen_at
        assert freed_s < bound_s, f"the receiver was blocked {freed_s:.1f} s"
        assert held == module_checksums(models.many_tensors(seed=0)), "the receiver holds part of the frozen round"
        assert HTTPVLLMWeightSyncClient(receiver.url).is_paused() == [False]
    finally:
        os.kill(trainer.pid, signal.SIGKILL)  # a stopped process dies of it too
        trainer.join(timeout=30)
    table.add(f"trainer frozen (mid-stream {transport})", "-", freed_s, "server held old, served again")
    assert_next_trainer_delivers(receiver, models.many_tensors(seed=5), transport=transport)
    receiver.kill()


FROZEN_AT_JOIN = """
import os, signal, sys, time, torch
from wt_callbacks.transfer.backends.torch_dist.group import TransferGroup, open_store
stage, session_id, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
store = open_store("127.0.0.1", 0, 2, is_master=True, timeout_s=timeout_s)
keys = store.num_keys()
print(store.port, flush=True)
while stage == "rendezvous" and store.num_keys() == keys:  # until the worker's gloo rendezvous began
    time.sleep(0.001)
if stage == "ring":  # rank 0 joins over gloo: it offers no ring, which the worker (shm) then waits for
    TransferGroup.connect(store, master_address="127.0.0.1", rank=0, world_size=2, timeout_s=timeout_s,
                          transport="gloo", device=torch.device("cpu"), session_id=session_id)
os.kill(os.getpid(), signal.SIGSTOP)
"""
"""Rank 0 of a rendezvous that freezes itself (SIGSTOP) at a stage of a
worker's join: before the store's handshake, during the gloo rendezvous, or
once the group formed, before the shared-memory ring's offer."""
JOIN_STAGES = ["handshake", "ring"] + (["rendezvous"] if FULL_MATRIX else [])


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("stage", JOIN_STAGES, ids=[f"trainer-frozen-at-{s}" for s in JOIN_STAGES])
def test_trainer_frozen_while_a_server_joins(forks, table, stage):
    """A trainer frozen during ``init_weight_transfer_engine``: every wait of
    the server's join on the trainer's store gives up past ``timeout_s``
    (+ ``STORE_SLACK_S``), the call fails, and the server is free for the
    next trainer, whose round delivers."""
    receiver = forks.start(FACTORY)
    before = receiver.checksums()
    session_id = new_session_id()
    trainer = subprocess.Popen(
        [sys.executable, "-c", FROZEN_AT_JOIN, stage, session_id, str(TIMEOUT_S)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = int(trainer.stdout.readline())
        deadline = time.monotonic() + 30
        while stage == "handshake" and not _stopped(trainer.pid):
            assert time.monotonic() < deadline, "the trainer did not freeze"
            time.sleep(0.01)
        init_info = {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "timeout_s": TIMEOUT_S, "transport": "shm" if stage == "ring" else "gloo", "session_id": session_id,
        }  # fmt: skip
        bound_s = TIMEOUT_S + STORE_SLACK_S + LOAD_SLACK_S
        start = time.monotonic()
        client = HTTPVLLMWeightSyncClient(receiver.url, timeout=CLIENT_TIMEOUT_S)
        joining = in_daemon_thread(lambda: client.init_weight_transfer_engine(init_info), "join")
        try:
            error = joining.exception(timeout=bound_s)
        except FutureTimeout:
            raise AssertionError(f"the server's join still waited {bound_s:g} s after the trainer froze") from None
        failed_s = time.monotonic() - start
        assert error is not None and "no answer within" in str(error), error
        client.close()
        assert _stopped(trainer.pid), "the trainer was not frozen all along"
        assert receiver_checksums(receiver.url, timeout_s=LOAD_SLACK_S) == before  # it answers: the lock is free
    finally:
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
    table.add(f"trainer frozen (at a server's {stage})", "-", failed_s, "init failed, server free")
    assert_next_trainer_delivers(receiver, models.many_tensors(seed=5))
    receiver.kill()
