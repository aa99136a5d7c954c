"""torch_dist's shm transport end to end: a trainer streams through /dev/shm into receiver processes.

Checksums are sha256 per parameter, so "equal" means bitwise equal. Every
test also checks that no ring file of ours is left in /dev/shm.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import threading
import time

import pytest
import requests
import torch

from tests.support.transfer import LOCAL, TIMEOUT_S, InterruptingSource, connect, ring_files
from wt_callbacks.checksums import module_checksums
from wt_callbacks.demos import models
from wt_callbacks.demos.receiver_process import receiver_checksums
from wt_callbacks.transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferError,
    WeightTransferTrainerFactory,
)
from wt_callbacks.transfer.backends.torch_dist.shm_files import SHM_DIR
from wt_callbacks.transfer.backends.torch_dist.shm_ring import HEARTBEAT_TIMEOUT_S, SHM_SLOT_BYTES, SHM_SLOTS

# A mount namespace with a fresh tmpfs on /dev/shm: the receiver sees its own,
# empty /dev/shm, as in a container without --ipc=host. It is a simulation
# only in that the "container" is a namespace set up here; the failure is the
# real one (the ring's path does not exist for that process).
PRIVATE_SHM = (
    "unshare", "--user", "--map-root-user", "--mount",
    "sh", "-c", f'mount -t tmpfs tmpfs {SHM_DIR} && exec "$0" "$@"',
)  # fmt: skip


# Every test here also fails if it leaves a ring file of ours behind.
pytestmark = pytest.mark.usefixtures("no_ring_left_behind")


@pytest.fixture
def private_shm():
    """The ``wrapper`` that starts a receiver with its own /dev/shm."""
    probe = subprocess.run([*PRIVATE_SHM, "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"user/mount namespaces unavailable here: {probe.stderr.decode().strip()}")
    return PRIVATE_SHM


@pytest.mark.parametrize(
    ("factory", "config"),
    [
        pytest.param("mixed_model", {}, id="packed-default"),
        pytest.param("mixed_model", {"packed": False}, id="unpacked"),
        pytest.param("mixed_model", {"packed_buffer_size_bytes": 4096}, id="many-small-chunks"),
        pytest.param("ring_overflow", {}, id="tensor-larger-than-ring-packed"),
        pytest.param("ring_overflow", {"packed": False}, id="tensor-larger-than-ring-unpacked"),
    ],
)
def test_arrives_bitwise(receiver_proc, factory, config):
    receiver = receiver_proc(f"wt_callbacks.demos.models:{factory}")
    model = getattr(models, factory)(seed=0)
    if factory == "ring_overflow":
        assert max(p.numel() * p.element_size() for p in model.parameters()) > SHM_SLOTS * SHM_SLOT_BYTES
    client, engine = connect(receiver.url, ModuleSource(model), transport="shm", **config)
    try:
        assert engine.group.transport == "shm"
        for version in ("v1", "v2"):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
            engine.send_weights(version)
            assert receiver_checksums(receiver.url) == module_checksums(model)
        assert client.weight_info()[0]["version_history"] == ["v1", "v2"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("factory", ["ring_overflow", "mixed_model"])
def test_bf16_wire(receiver_proc, factory):
    """fp32 parameters are cast by the ring as it copies them in (one through
    every slot more than once); bf16 and non-contiguous ones go as they are or
    converted first."""
    receiver = receiver_proc(f"wt_callbacks.demos.models:{factory}")
    model = getattr(models, factory)(seed=0)
    client, engine = connect(receiver.url, ModuleSource(model), transport="shm", dtype="bfloat16")
    try:
        engine.send_weights("bf16")
        assert receiver_checksums(receiver.url) == module_checksums(model, via_dtype=torch.bfloat16)
        assert engine.last_stats.bytes == sum(p.numel() * 2 for p in model.parameters())
        # The receiver reports what arrived, bf16 bytes, also for tensors it
        # converted into its fp32 spares as they came out of the ring.
        wire_mb = f"{sum(p.numel() * 2 for p in model.parameters()) / 1e6:.1f} MB"
        deadline = time.monotonic() + 10
        while f"weight update bf16: {len(list(model.parameters()))} tensors, {wire_mb}" not in receiver.log:
            assert time.monotonic() < deadline, receiver.log[-2000:]
            time.sleep(0.1)
    finally:
        engine.shutdown()


def test_the_rings_single_threaded_casts_leave_other_threads_alone(receiver_proc):
    """The ring's thread casts on one intra-op thread, but a thread started
    after it keeps the process's setting (it fell to 1: the ring set torch's
    process-wide default, so a trainer's data-loading threads and a server's
    handlers ran single-threaded from the first sync on)."""
    receiver = receiver_proc("wt_callbacks.demos.models:mixed_model")
    model = models.mixed_model(seed=0)
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # not this host's default, so a reset to it shows too
    try:
        client, engine = connect(receiver.url, ModuleSource(model), transport="shm", dtype="bfloat16")
        try:
            engine.send_weights("bf16")
            assert receiver_checksums(receiver.url) == module_checksums(model, via_dtype=torch.bfloat16)
        finally:
            engine.shutdown()
        seen: list[int] = []

        def later_thread() -> None:
            torch.ones(256, 256).sum()  # a parallel op: when a thread takes up the default
            seen.append(torch.get_num_threads())

        thread = threading.Thread(target=later_thread)
        thread.start()
        thread.join(timeout=30)
        assert seen == [3] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_one_round_reaches_two_receivers(receiver_proc):
    first, second = receiver_proc("wt_callbacks.demos.models:ring_overflow"), receiver_proc("wt_callbacks.demos.models:ring_overflow")
    model = models.ring_overflow(seed=0)
    client, engine = connect([first.url, second.url], ModuleSource(model), transport="shm", packed_buffer_size_bytes=1 << 20)
    try:
        assert engine.worker_init_info["world_size"] == 3 and engine.group.transport == "shm"
        engine.send_weights("fan-out")
        assert receiver_checksums(first.url) == receiver_checksums(second.url) == module_checksums(model)
    finally:
        engine.shutdown()


def test_auto_on_loopback_uses_shm_and_unlinks_the_ring_once_mapped(receiver_proc):
    receiver = receiver_proc()
    model = models.tiny_mlp(seed=0)
    before = ring_files(created_by=os.getpid())
    client, engine = connect(receiver.url, ModuleSource(model))  # transport: auto
    try:
        assert engine.worker_init_info["transport"] == "shm"
        assert engine.group.transport == "shm"
        # Every rank mapped the ring, so its file is already gone: a crash from
        # here on cannot leak it.
        assert ring_files(created_by=os.getpid()) == before
        engine.send_weights("auto")
        assert receiver_checksums(receiver.url) == module_checksums(model)
    finally:
        engine.shutdown()
    receiver.stop()
    assert ring_files(created_by=os.getpid()) == before


def test_auto_falls_back_to_gloo_when_a_worker_cannot_map_the_ring(receiver_proc, private_shm, caplog):
    shared = receiver_proc()
    isolated = receiver_proc(wrapper=private_shm)
    model = models.tiny_mlp(seed=0)
    with caplog.at_level(logging.WARNING, logger="wt_callbacks.transfer.backends.torch_dist.shm_negotiation"):
        client, engine = connect([shared.url, isolated.url], ModuleSource(model))
    try:
        assert engine.worker_init_info["transport"] == "shm"
        assert engine.group.transport == "gloo"
        assert "shared-memory ring unavailable (rank 2 cannot: " in caplog.text
        assert "every rank uses gloo broadcasts" in caplog.text
        engine.send_weights("fallback")
        expected = module_checksums(model)
        assert receiver_checksums(shared.url) == receiver_checksums(isolated.url) == expected
    finally:
        engine.shutdown()


def test_explicit_shm_that_a_worker_cannot_map_names_the_fix(receiver_proc, private_shm):
    isolated = receiver_proc(wrapper=private_shm)
    model = models.tiny_mlp(seed=0)
    start = time.monotonic()
    with pytest.raises(WeightTransferError, match=r"transport='shm' needs a shared-memory ring .*every inference worker maps.*transport='gloo'") as failure:
        connect(isolated.url, ModuleSource(model), transport="shm")
    assert "run the servers on the trainer's host" in str(failure.value).lower()
    assert time.monotonic() - start < TIMEOUT_S
    # The worker left the half-formed group: gloo works right away.
    client, engine = connect(isolated.url, ModuleSource(model), transport="gloo")
    engine.send_weights("gloo")
    engine.shutdown()
    assert receiver_checksums(isolated.url) == module_checksums(model)


def _trainer_until_killed(url: str, stalled, timeout_s: float) -> None:
    """Yields 100 tensors, sets ``stalled``, then blocks mid-round until killed."""

    def stall() -> None:
        stalled.set()
        time.sleep(3600)

    model = models.many_tensors(seed=0)
    engine = WeightTransferTrainerFactory.trainer_init(
        "torch_dist", {"timeout_s": timeout_s, "transport": "shm", "packed_buffer_size_bytes": 4096}, LOCAL,
        client=HTTPVLLMWeightSyncClient(url, timeout=timeout_s), source=InterruptingSource(model, stall, after=100),
    )  # fmt: skip
    engine.send_weights("never")


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        pytest.param(signal.SIGKILL, "exited while this worker waited", id="killed"),
        pytest.param(signal.SIGSTOP, "the trainer's heartbeat stopped", id="frozen"),
    ],
)
def test_a_trainer_that_dies_or_hangs_mid_round_fails_the_update_before_its_timeout(receiver_proc, fault, reason):
    """Killed, the trainer is seen gone at once (its process, on this host);
    frozen (SIGSTOP: alive, its memory mapped), its heartbeat stops. Either
    way the receiver leaves the update long before ``timeout_s``."""
    receiver = receiver_proc("wt_callbacks.demos.models:many_tensors")
    before = receiver_checksums(receiver.url)
    timeout_s = 120.0
    ctx = multiprocessing.get_context("spawn")
    stalled = ctx.Event()
    trainer = ctx.Process(target=_trainer_until_killed, args=(receiver.url, stalled, timeout_s), daemon=True)
    trainer.start()
    try:
        assert stalled.wait(60), "the trainer never got mid-round"
        # The receiver has taken the first chunks and waits in the ring for the next.
        os.kill(trainer.pid, fault)
        struck = time.monotonic()
        # This call queues behind the update in progress: it returns once the
        # receiver gave up on the trainer.
        response = requests.post(f"{receiver.url}/shutdown_weight_transfer_engine", timeout=timeout_s)
        waited = time.monotonic() - struck
    finally:
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.join(timeout=10)
    assert response.status_code == 200, response.text
    assert waited < (HEARTBEAT_TIMEOUT_S if fault == signal.SIGKILL else HEARTBEAT_TIMEOUT_S + 10), waited
    # The failed update logs its error on its own thread, which may run after
    # the lock it released let the shutdown answer: give the line a moment.
    deadline = time.monotonic() + 10
    while reason not in receiver.log and time.monotonic() < deadline:
        time.sleep(0.1)
    assert reason in receiver.log
    assert receiver_checksums(receiver.url) == before
    assert requests.get(f"{receiver.url}/weight_info", timeout=30).json()["updates_completed"] == 0
    print(f"{'killed' if fault == signal.SIGKILL else 'frozen'} trainer: the receiver left the update after {waited:.2f} s")
