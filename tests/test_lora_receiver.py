"""LoRA (PEFT) models into the reference receiver, in both modes, proved bitwise by its checksums.

The receiver serves a LoRA adapter as vLLM does (the round writes the
version on its disk, ``/v1/load_lora_adapter`` loads it, ``"model":
lora_name`` is served with it applied) and reports the sha256 of every
adapter tensor it loaded. After Lightning, TRL (``peft_config``), FSDP2 and
ZeRO-3 runs (those two in ``test_vllm_lora.py``, beside a vLLM server:
one broadcast reaches both): with ``lora: adapter`` it holds bitwise the trainer's adapter
and its base is untouched; with ``lora: merge`` its weights are bitwise the
merged model (PEFT's rule in float32). Every round is verified (served
logprobs within 1e-4 of the trainer's PEFT model). Accelerate's hook finds
the PEFT model in what ``accelerator.prepare`` returned.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.lightning_app import run as lightning_run
from tests.support.lora import ADAPTER, FAMILY, MERGED, base_model, peft_model, section, trl_run
from wt_callbacks.checksums import module_checksums, tensor_sha256
from wt_callbacks.demos import tiny_lms, toy_task
from wt_callbacks.lora import files
from wt_callbacks.lora.adapter import AdapterSource
from wt_callbacks.receiver import Receiver
from wt_callbacks.transfer import ModuleSource

peft = pytest.importorskip("peft")


@pytest.fixture
def receiver(tmp_path, monkeypatch):
    monkeypatch.setenv("WT_LORA_DIR", str(tmp_path / "adapters"))  # where the receiver writes versions
    with Receiver(base_model()) as running:
        running.start()
        yield running


def sent_checksums(source) -> dict[str, str]:
    return {name: tensor_sha256(tensor) for name, tensor in source}


def lightning(receiver, tmp_path, config: dict, **keys) -> torch.nn.Module:
    state_path = tmp_path / "trained.pt"
    result = lightning_run(
        section(receiver.url, module="model", every_n_train_steps=2, **keys),
        task="toy-lm", family="llama_tied", peft=config, max_steps=4, state_out=str(state_path),
    )  # fmt: skip
    assert result["state"]["syncs_completed"] == 3  # step-0, 2, 4: each verified
    return peft_model(config, torch.load(state_path))


def assert_holds_adapter(receiver, model: torch.nn.Module, name: str) -> None:
    held = receiver.core.weight_checksums()
    assert held["adapters"][name]["checksums"] == sent_checksums(AdapterSource(model))
    assert held["checksums"] == module_checksums(base_model())  # the base untouched


def assert_holds_merged(receiver, model: torch.nn.Module) -> None:
    assert module_checksums(receiver.model) == sent_checksums(ModuleSource(model))


def test_lightning_adapter(receiver, tmp_path):
    model = lightning(receiver, tmp_path, ADAPTER, lora="adapter", lora_name="policy")
    assert_holds_adapter(receiver, model, "policy")
    # Each version is read once into memory: its files do not pile up on the receiver's disk.
    assert not list((tmp_path / "adapters").rglob(files.WEIGHTS_FILE))


def test_lightning_merge(receiver, tmp_path):
    assert_holds_merged(receiver, lightning(receiver, tmp_path, MERGED))


# Rounds sent in the background (and a merge committed staged) end holding the
# last step's weights too; a round ends after training moved on, so it is not
# verified in flight: the checksums after fit are the check.
BACKGROUND = {"send": "async", "verify_every_n_syncs": 0}


def test_lightning_adapter_sent_async(receiver, tmp_path):
    model = lightning(receiver, tmp_path, ADAPTER, lora="adapter", lora_name="policy", **BACKGROUND)
    assert_holds_adapter(receiver, model, "policy")


def test_lightning_merge_sent_async_committed_staged(receiver, tmp_path):
    assert_holds_merged(receiver, lightning(receiver, tmp_path, MERGED, commit="staged", **BACKGROUND))


@pytest.mark.parametrize("mode", ["adapter", "merge"])
def test_trl(receiver, tmp_path, mode):
    pytest.importorskip("trl")
    if mode == "adapter":
        assert_holds_adapter(receiver, trl_run(tmp_path, section(receiver.url, lora="adapter", lora_name="trl")), "trl")
    else:
        assert_holds_merged(receiver, trl_run(tmp_path, section(receiver.url)))


@pytest.mark.parametrize("mode", ["adapter", "merge"])
def test_accelerate(receiver, mode):
    from accelerate import Accelerator

    from wt_callbacks.integrations.accelerate import WeightSyncHook

    accelerator = Accelerator(cpu=True)
    model = peft_model(ADAPTER if mode == "adapter" else MERGED).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    keys = {"lora": "adapter", "lora_name": "acc"} if mode == "adapter" else {}
    tokenizer, rng = toy_task.build_tokenizer(), random.Random(0)
    with WeightSyncHook(accelerator, model, optimizer, hparams=section(receiver.url, every_n_train_steps=2, **keys)) as hook:
        for _ in range(4):
            accelerator.backward(model(**toy_task.training_batch(tokenizer, rng, 8)).loss)
            optimizer.step()
            optimizer.zero_grad()
    assert hook.weight_sync.syncs_completed == 3  # before the first step, after 2 and 4: each verified
    trained = accelerator.unwrap_model(model).eval()
    if mode == "adapter":
        assert_holds_adapter(receiver, trained, "acc")
    else:
        assert_holds_merged(receiver, trained)


def test_merge_rounds_leave_the_frozen_tensors_the_servers_hold(tmp_path):
    """``send_frozen: once``, the default for a merged PEFT model: after a
    connection's first round, rounds leave out the frozen base tensors (the
    tied embedding, the norms), fewer bytes for the same served model, each
    round verified. A server that replaced the one holding them (another
    process at the same address, with other weights) gets them again."""
    from wt_callbacks.config import SyncConfig
    from wt_callbacks.demos.multiprocess import free_port
    from wt_callbacks.sync import WeightSync

    model = peft_model(MERGED).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokenizer, rng = toy_task.build_tokenizer(), random.Random(0)
    source = ModuleSource(model)
    frozen = source.frozen_names()
    assert {n for n in frozen if ".layers." not in n} == {"model.embed_tokens.weight", "model.norm.weight"}
    kept_bytes = sum(m.nbytes for m in source.metadata() if m.name in frozen)

    def train_step() -> None:
        model(**toy_task.training_batch(tokenizer, rng, 8)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    port = free_port()
    first = Receiver(base_model())
    url = first.start(port=port)
    sync = WeightSync(SyncConfig(**section(url, on_error="warn")))
    try:
        sync.setup(model, 0, 1)
        sent = []
        for step in range(3):
            if step:
                train_step()
            sent.append(sync.sync(step).bytes)
        assert sent[1] == sent[2] == sent[0] - kept_bytes, (sent, kept_bytes)
        assert_holds_merged(first, model)
        first.stop()
        with Receiver(tiny_lms.TINY_LMS[FAMILY](seed=1).eval()) as second:
            second.start(port=port)
            assert sync.sync(3) is None  # the group with the first server is gone: a failed round, warned
            assert sync.sync(4).bytes == sent[0]  # a new connection: everything, verified
            assert_holds_merged(second, model)
    finally:
        sync.close()
        first.stop()
    every_round = WeightSync(SyncConfig(**section(url, send_frozen="every_round")))
    with Receiver(base_model()) as third:
        third.start(port=port)
        try:
            every_round.setup(model, 0, 1)
            assert every_round.sync(0).bytes == every_round.sync(1).bytes == sent[0]
        finally:
            every_round.close()
