"""``send: async`` and ``commit: staged`` into reference receivers.

Rounds are held at a chosen server call (``FaultyClient``: the call waits for
an event before it goes out), so what happens while a round is in flight, or
while a server stages one, is decided by the test, not by timing: training
changes the weights before a held round streams, a due round finds the
previous one in flight, a checkpoint is taken meanwhile. The servers are real
receivers (in this process, or their own process where one is killed), the
trainer the real ``WeightSync``; two trainer ranks are two processes (FSDP2).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.faults import FaultyClient
from tests.support.transfer import InterruptingSource
from tests.test_weight_sync import config, policy, receiver, served_info, tiny_lm  # noqa: F401 - receiver: a fixture
from wt_callbacks import async_send
from wt_callbacks.checksums import module_checksums
from wt_callbacks.demos import toy_task
from wt_callbacks.demos.multiprocess import free_port, leave_group_together
from wt_callbacks.receiver import Receiver
from wt_callbacks.sync import Collectives, WeightSync
from wt_callbacks.transfer import HTTPVLLMWeightSyncClient, WeightTransferError

TIMEOUT_S = 20


def trained(model: torch.nn.Module, by: float = 0.5) -> None:
    """An optimizer step, as far as the weights can tell."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def held_client(url: str) -> tuple[FaultyClient, threading.Event]:
    """A client whose call armed with ``hold_before`` waits for the event."""
    return FaultyClient(HTTPVLLMWeightSyncClient(url, timeout=TIMEOUT_S)), threading.Event()


def test_async_rounds_send_the_snapshot_step_while_training_runs_on(receiver):
    trainer = policy(1)
    client, release = held_client(receiver.url)
    ws = WeightSync(config(receiver.url, send="async", async_overflow="skip"), client=client)
    ws.setup(trainer)
    try:
        cold = ws.sync_at_fit_start(0)  # waits for its round
        assert cold is not None and module_checksums(receiver.model) == module_checksums(trainer.model)

        # Round 1 is held before its first call: training steps on before a byte of it moves.
        client.strike_before("start_weight_update", release.wait)
        trained(trainer)
        assert ws.maybe_sync(1) is False  # launched; nothing to collect yet
        at_step_1 = module_checksums(trainer.model)
        trained(trainer)
        assert ws.maybe_sync(2) is False and ws.skipped == 1  # round 1 still in flight: skipped
        assert ws.gauges(2) == {"weight_sync/failures": 0.0, "weight_sync/skipped": 1.0, "weight_sync/steps_behind": 2.0}
        release.set()
        assert ws.state_dict()["last_synced_step"] == 1  # a checkpoint waits for the round in flight

        # The next due round collects round 1 (and is held itself, before it streams).
        hold_3 = threading.Event()
        client.strike_before("start_weight_update", hold_3.wait)
        trained(trainer)
        assert ws.maybe_sync(3) is True
        collected = ws.last_result
        assert collected is not None and collected.step == 1 and collected.version == "step-1"
        assert module_checksums(receiver.model) == at_step_1 != module_checksums(trainer.model)
        metrics = collected.metrics()
        assert {"weight_sync/stall_seconds", "weight_sync/snapshot_seconds", "weight_sync/latency_seconds",
                "weight_sync/generation_paused_seconds"} <= set(metrics)  # fmt: skip
        assert collected.bytes == sum(p.numel() * 4 for p in trainer.model.parameters())
        at_step_3 = module_checksums(trainer.model)
        trained(trainer)  # training runs on while round 3 is in flight
        hold_3.set()
        final = ws.sync_at_train_end(3)  # collects round 3: step 3 is on the servers, no final round
        assert final is not None and final.step == 3
        assert module_checksums(receiver.model) == at_step_3
        assert served_info(receiver.url)["version_history"] == ["step-0", "step-1", "step-3"]
        assert ws.state_dict()["syncs_completed"] == 3 and ws.state_dict()["skipped"] == 1
    finally:
        ws.close()


def test_a_checkpoint_records_only_what_the_servers_acknowledged(receiver):
    """``state_dict`` waits for the round in flight and counts its outcome
    (without applying ``on_error``: the next meeting point does that)."""
    trainer = policy(1)
    client, release = held_client(receiver.url)
    ws = WeightSync(config(receiver.url, send="async", on_error="warn"), client=client)
    ws.setup(trainer)
    try:
        ws.sync_at_fit_start(0)
        client.strike_before("finish_weight_update", release.wait)
        trained(trainer)
        ws.maybe_sync(1)
        threading.Timer(0.2, release.set).start()
        state = ws.state_dict()  # a checkpoint while round 1 is in flight
        assert state["last_synced_step"] == 1 and state["syncs_completed"] == 2
        assert ws.syncs_completed == 1  # counted where the ranks meet next

        # A round that fails in flight is not recorded as synced.
        client.strike_before("finish_weight_update", lambda: receiver.stop())
        trained(trainer)
        assert ws.maybe_sync(2) is True  # collects round 1, launches round 2
        state = ws.state_dict()
        assert state["last_synced_step"] == 1 and state["failures"] == 1
    finally:
        ws.close()
    with Receiver(tiny_lm(3)) as restarted:
        restored = WeightSync(dataclasses.replace(ws.config, servers=[restarted.start()]))
        restored.load_state_dict(state)
        restored.setup(trainer)
        try:
            assert restored.sync_at_fit_start(2) is not None  # resume: the cold sync waits for its round
            assert module_checksums(restarted.model) == module_checksums(trainer.model)
            assert restored.state_dict()["syncs_completed"] == 3
        finally:
            restored.close()


def test_warn_reconnects_in_the_background_once_the_server_is_back(caplog):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    trainer = policy(1)
    first = Receiver(tiny_lm(0))
    first.start(port=port)
    ws = WeightSync(config(url, send="async", on_error="warn"))
    ws.setup(trainer)
    try:
        assert ws.sync_at_fit_start(0) is not None
        first.stop()
        trained(trainer)
        ws.maybe_sync(1)  # fails in the background
        with Receiver(tiny_lm(2)) as second:
            second.start(port=port)
            trained(trainer)
            assert ws.maybe_sync(2) is False  # collects round 1's failure; round 2 connects again
            assert ws.failures == 1
            assert "weight sync round for step 1 (version 'step-1') failed on trainer rank 0" in caplog.text
            assert "detected at step 2" in caplog.text
            result = ws.sync_at_train_end(2)
            assert result is not None and result.step == 2
            assert module_checksums(second.model) == module_checksums(trainer.model)
            assert served_info(url)["version_history"] == ["step-2"]
    finally:
        ws.close()


def test_a_snapshot_that_does_not_fit_fails_in_setup_naming_its_bytes(receiver, monkeypatch):
    # The host's free memory is what cannot be made small here: the check reads it through this function.
    monkeypatch.setattr(async_send, "available_host_bytes", lambda: 100)
    nbytes = sum(p.numel() * 2 for p in policy(1).model.parameters())
    ws = WeightSync(config(receiver.url, send="async", dtype="bfloat16"))
    with pytest.raises(ValueError, match=rf"send: async needs a host snapshot of {nbytes} bytes .* this host has 100 bytes"):
        ws.setup(policy(1))
    assert served_info(receiver.url)["updates_completed"] == 0


# --------------------------------------------------------------------------- #
# commit: staged
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("send,commit", [("blocking", "staged"), ("async", "staged"), ("blocking", "prepared")])
def test_staged_commit_serves_while_the_round_streams_and_pauses_only_to_commit(send, commit):
    """While the round streams (``blocking``: the trainer stalls mid-stream),
    or once it is staged whole and before its commit (``async``: held before
    the pause), the server is not paused and answers completions from the
    old weights; the round's weights are served once it finished."""
    tokenizer = toy_task.build_tokenizer()
    trainer = toy_task.build_model(tokenizer, seed=1)
    with Receiver(toy_task.served_model(), tokenizer=tokenizer) as receiver:
        url = receiver.start()
        old = module_checksums(receiver.model)
        seen: dict = {}

        def mid_stream() -> None:
            seen["paused"] = HTTPVLLMWeightSyncClient(url, timeout=TIMEOUT_S).is_paused()
            answer = requests.post(f"{url}/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 2}, timeout=TIMEOUT_S)
            seen["completion"] = answer.status_code
            seen["checksums"] = module_checksums(receiver.model)

        client = FaultyClient(HTTPVLLMWeightSyncClient(url, timeout=TIMEOUT_S))
        ws = WeightSync(config(url, module=None, commit=commit, send=send), client=client)
        ws.setup(trainer)
        try:
            if send == "blocking":
                ws.engine.source = InterruptingSource(ws.engine.source, mid_stream, after=3)
            else:
                client.strike_before("pause", mid_stream)
            result = ws.sync_at_fit_start(0)
        finally:
            ws.close()
        assert seen == {"paused": [False], "completion": 200, "checksums": old}
        assert result is not None and 0 < result.generation_paused_seconds < result.seconds
        assert module_checksums(receiver.model) == module_checksums(trainer)


def test_the_pause_for_a_commit_waits_until_the_servers_staged_the_round(monkeypatch):
    """A server still copying the round into staging when the trainer sent
    its last byte (here: its staging slowed down at the end) is paused for
    the commit only once it holds all of it, not while it stages."""
    from wt_callbacks.receiver.staging import StagedWeights

    seen: dict = {}
    staging = StagedWeights.load_weights

    def slow_to_end(self, weights) -> None:
        staging(self, weights)
        time.sleep(0.5)
        seen["staged"] = time.monotonic()

    monkeypatch.setattr(StagedWeights, "load_weights", slow_to_end)
    trainer = policy(1)
    with Receiver(tiny_lm(0)) as receiver:
        url = receiver.start()
        client = FaultyClient(HTTPVLLMWeightSyncClient(url, timeout=TIMEOUT_S))
        client.strike_before("pause", lambda: seen.setdefault("paused", time.monotonic()))
        ws = WeightSync(config(url, commit="staged"), client=client)
        ws.setup(trainer)
        try:
            assert ws.sync(1) is not None
        finally:
            ws.close()
    assert seen["paused"] >= seen["staged"]


@pytest.mark.parametrize(
    "server_floor, keys, awaited, runs_at",
    [
        ("5", {}, True, 5), ("5", {"staging_nice": 12}, True, 12), ("5", {"staging_nice": 2}, True, 5),
        (None, {"send": "async"}, False, 10), (None, {"send": "async"}, True, 0),
    ],
)  # fmt: skip
def test_a_staged_round_is_received_at_the_niceness_asked(monkeypatch, server_floor, keys, awaited, runs_at):
    """The thread a staged round is received on runs at the round's
    ``staging_nice`` (left out: 10 for a ``send: async`` round the training
    loop does not wait for, 0 for the cold sync it waits for), or at the
    server's ``WT_STAGING_NICE`` where higher; the rest of the server as it was."""
    from wt_callbacks.receiver.staging import StagedWeights

    seen: dict = {}
    staging = StagedWeights.load_weights

    def noting_niceness(self, weights) -> None:
        seen["staging"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        staging(self, weights)

    monkeypatch.setattr(StagedWeights, "load_weights", noting_niceness)
    if server_floor is None:
        monkeypatch.delenv("WT_STAGING_NICE", raising=False)
    else:
        monkeypatch.setenv("WT_STAGING_NICE", server_floor)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    trainer = policy(1)
    with Receiver(tiny_lm(0)) as receiver:
        url = receiver.start()
        ws = WeightSync(config(url, commit="prepared", **keys), client=HTTPVLLMWeightSyncClient(url, timeout=TIMEOUT_S))
        ws.setup(trainer)
        try:
            if awaited:
                assert ws.sync_at_fit_start(1) is not None  # waits for its round under send: async too
            else:
                assert ws.sync(1) is None  # in the background under send: async, collected at the end
                assert ws.sync_at_train_end(1) is not None
        finally:
            ws.close()
        assert module_checksums(receiver.model) == module_checksums(trainer.model)
    assert seen["staging"] == max(before, runs_at) and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_a_failed_staging_never_touches_the_served_model(caplog):
    """A round cut mid-stream, and one whose pause fails once every byte
    arrived: the server discards the stage (the trainer left the group
    before its clean-up finish) and keeps serving the old weights; the next
    round delivers."""
    trainer = policy(1)
    with Receiver(tiny_lm(0)) as receiver:
        url = receiver.start()
        old = module_checksums(receiver.model)
        client = FaultyClient(HTTPVLLMWeightSyncClient(url, timeout=TIMEOUT_S))
        ws = WeightSync(config(url, commit="staged", on_error="warn"), client=client)
        ws.setup(trainer)
        try:

            def cut() -> None:
                raise RuntimeError("the trainer's source failed mid-stream")

            ws.engine.source = InterruptingSource(ws.engine.source, cut, after=4)
            assert ws.sync(1) is None
            assert module_checksums(receiver.model) == old

            def refused() -> None:
                raise RuntimeError("the pause was refused")

            client.strike_before("pause", refused)
            assert ws.sync(2) is None
            assert module_checksums(receiver.model) == old
            assert "the trainer left the transfer group before it committed the staged update" in caplog.text
            info = served_info(url)
            assert info["updates_completed"] == 0 and info["weight_version"] == "default"
            assert client.inner.is_paused() == [False]

            assert ws.sync(3) is not None
            assert module_checksums(receiver.model) == module_checksums(trainer.model)
        finally:
            ws.close()


# --------------------------------------------------------------------------- #
# Two trainer ranks (FSDP2): a server killed while a round is in flight
# --------------------------------------------------------------------------- #


def served_lm() -> torch.nn.Module:
    """The receivers' model (``--module-factory tests.test_async_send:served_lm``)."""
    return tiny_lm(0)


def _fsdp_async_rank(rank: int, pg_port: int, urls: list[str], pids: list[int], out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    out: dict = {}
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("wt_callbacks.sync").addHandler(handler)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = tiny_lm(1)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        collectives = Collectives.from_torch_distributed()
        for on_error, url, pid in zip(("warn", "raise"), urls, pids):
            client = FaultyClient(HTTPVLLMWeightSyncClient(url, timeout=TIMEOUT_S)) if rank == 0 else None
            cfg = config(url, module=None, send="async", on_error=on_error, config={"packed_buffer_size_bytes": 64})
            ws = WeightSync(cfg, client=client)
            ws.setup(model, rank, 2, collectives=collectives)
            ws.sync_at_fit_start(0)
            if rank == 0:  # the server dies once round 1's update goes out, on rank 0's thread
                client.strike_before("update_weights", lambda pid=pid: os.kill(pid, signal.SIGKILL))
            trained(model)
            first = ws.maybe_sync(1)
            trained(model)
            try:
                second = ws.maybe_sync(2)  # the next meeting point
                out[on_error] = {"returned": [first, second], "failures": ws.failures, "warnings": list(records)}
            except WeightTransferError as e:
                out[on_error] = {"returned": [first], "raised": str(e)}
            ws.close()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        leave_group_together()


@pytest.mark.slow
def test_a_server_killed_mid_round_surfaces_at_the_next_meeting_point_on_every_rank(receiver_proc, tmp_path):
    receivers = [receiver_proc("tests.test_async_send:served_lm") for _ in range(2)]
    urls, pids = [r.url for r in receivers], [r.proc.pid for r in receivers]
    mp.spawn(_fsdp_async_rank, args=(free_port(), urls, pids, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        warn, raised = out["warn"], out["raise"]
        # Under warn every rank logs the failure at step 2 and trains on.
        assert warn["returned"] == [False, False] and warn["failures"] == 1
        (line,) = [w for w in warn["warnings"] if "round for step 1" in w]
        assert "weight sync round for step 1 (version 'step-1') failed on trainer rank 0" in line
        assert "detected at step 2" in line and "training continues" in line
        # Under raise every rank raises there, naming both steps.
        assert raised["returned"] == [False]
        assert "weight sync round for step 1 (version 'step-1') failed on trainer rank 0" in raised["raised"]
        assert "detected at step 2" in raised["raised"]
