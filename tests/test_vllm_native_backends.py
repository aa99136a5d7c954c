"""Trainer backends ``nccl`` / ``ipc``: stock vLLM's own wire, through vLLM's own code.

vLLM's NCCL and IPC engines need CUDA, which these machines do not have, so
the success path runs against a fake ``vllm`` package (tests/support/fake_vllm)
that records what our adapters hand over and drives the client as vLLM's
engines do, as vLLM 0.32 and as 0.33. The failure path (no vllm in the
trainer) is real. So is released vLLM's call form on ``torch_dist``.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from tests.support import REPO_ROOT
from wt_callbacks.demos import models
from wt_callbacks.transfer import ModuleSource, WeightTransferTrainerFactory

LOCAL = {"master_address": "127.0.0.1", "master_port": 29777, "rank": 0}


class RecordingClient:
    def __init__(self, world_size: int = 2):
        self.calls: list = []
        self.world_size = world_size

    def init_weight_transfer_engine(self, init_info):
        self.calls.append(("init", init_info))

    def start_weight_update(self):
        self.calls.append(("start",))

    def update_weights(self, update_info):
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))

    def update_weight_version(self, version):
        self.calls.append(("version", version))

    def get_world_size(self):
        return self.world_size


def test_without_vllm_in_the_trainer_the_error_names_the_fix():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed in this environment")
    for backend in ("nccl", "ipc"):
        with pytest.raises(ValueError, match=rf"backend '{backend}' drives vLLM's own transport and needs vllm .*'torch_dist'"):
            WeightTransferTrainerFactory.trainer_init(
                backend, {}, LOCAL if backend == "nccl" else {"rank": 0},
                client=RecordingClient(), source=ModuleSource(models.tiny_mlp(seed=0)),
            )  # fmt: skip


def _use_fake_vllm(monkeypatch, version: str):
    monkeypatch.setenv("WT_FAKE_VLLM_VERSION", version)
    monkeypatch.syspath_prepend(str(REPO_ROOT / "tests/support/fake_vllm"))
    return importlib.import_module("vllm")


@pytest.fixture(params=["0.32.0", "0.33.0"])
def fake_vllm(request, monkeypatch):
    yield _use_fake_vllm(monkeypatch, request.param)
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


def test_nccl_adapter_translates_config_world_size_dtype_and_version(fake_vllm):
    client = RecordingClient(world_size=4)
    model = models.tiny_mlp(seed=0)
    engine = WeightTransferTrainerFactory.trainer_init(
        "nccl", {"packed_buffer_size_bytes": 1 << 20, "dtype": "bfloat16"}, LOCAL, client=client, source=ModuleSource(model)
    )
    inner = engine.inner
    # world_size was asked from the servers: 1 trainer + 4 workers.
    assert (inner.init_info.world_size, inner.init_info.rank, inner.init_info.packed_buffer_size_bytes) == (5, 0, 1 << 20)
    assert inner.init_info.master_address == "127.0.0.1" and inner.init_info.master_port == 29777
    metadata = inner.source.metadata if fake_vllm.V033 else inner.source.metadata()
    assert [m.dtype for m in metadata] == [torch.bfloat16] * 6
    engine.send_weights("step-7")
    assert {dtype for _, dtype in inner.sent} == {torch.bfloat16}  # cast before leaving our source
    assert [c[0] for c in client.calls] == ["init", "start", "update", "finish", "version"]
    assert client.calls[-1] == ("version", "step-7")
    assert engine.last_stats.bytes == sum(p.numel() * 2 for p in model.parameters())
    engine.shutdown()
    assert inner.shut_down


def test_ipc_adapter_and_non_sender_ranks(fake_vllm):
    client = RecordingClient()
    engine = WeightTransferTrainerFactory.trainer_init(
        "ipc", {"packed": True}, {"rank": 1}, client=client, source=ModuleSource(models.tiny_mlp(seed=0))
    )
    assert engine.inner.init_info.packed and engine.inner.init_info.rank == 1
    engine.send_weights("v1")
    assert client.calls == []  # a non-sender rank never talks to the servers
    assert len(engine.inner.sent) == 6  # but it iterated the source (FSDP gathers)
    with pytest.raises(ValueError, match="unknown key 'master_address'"):
        WeightTransferTrainerFactory.trainer_init("ipc", {}, LOCAL, client=client, source=ModuleSource(torch.nn.Linear(1, 1)))


def test_a_vllm_release_the_adapters_do_not_speak_is_refused_naming_it(monkeypatch):
    _use_fake_vllm(monkeypatch, "0.31.0")
    try:
        with pytest.raises(ValueError, match=r"backend 'nccl': vllm 0.31.0 in the trainer is not supported; .* vllm 0.32 and 0.33"):
            WeightTransferTrainerFactory.trainer_init("nccl", {}, LOCAL, client=RecordingClient(), source=ModuleSource(models.tiny_mlp(seed=0)))
    finally:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]


def test_released_call_form_with_vllms_own_init_info(fake_vllm):
    """Code written for vLLM's trainer API: ``trainer_init(init_info, *, client, source)``."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    client = RecordingClient()
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=29777, world_size=3, packed=False, rank=0)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(models.tiny_mlp(seed=0)))
    assert (engine.inner.init_info.packed, engine.inner.init_info.world_size) == (False, 3)
    engine.send_weights("v1")
    engine.send_weights("v2")
    names = [call[1]["names"] for call in client.calls if call[0] == "update"]
    # 0.33 ships the metadata once; an unchanged round sends an empty update info.
    assert [len(n) for n in names] == ([6, 0] if fake_vllm.V033 else [6, 6])


class GatherCountingSource(ModuleSource):
    """Counts the tensors iterated, each an FSDP gather the other ranks join."""

    gathers = 0

    def __iter__(self):
        for item in super().__iter__():
            self.gathers += 1
            yield item


class RefusingFinish(RecordingClient):
    def finish_weight_update(self, weight_version=None):
        super().finish_weight_update(weight_version)
        raise RuntimeError("HTTP 500 at /finish_weight_update")


class RefusingStart(RecordingClient):
    def start_weight_update(self):
        raise RuntimeError("HTTP 409 at /start_weight_update")


@pytest.mark.parametrize("failure", ["refused start", "broadcast broken after 2 tensors", "refused finish"])
def test_a_failed_round_runs_as_many_gathers_as_the_other_ranks(fake_vllm, monkeypatch, failure):
    """A non-sender rank iterates the source once per round; the sender must
    too, whether vLLM failed before, during or after its pass, or the ranks'
    next collectives pair a surplus gather with the training step's."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    client = {"refused start": RefusingStart, "refused finish": RefusingFinish}.get(failure, RecordingClient)()
    if failure.startswith("broadcast"):
        monkeypatch.setattr(NCCLTrainerWeightTransferEngine, "broadcast_fails_after", 2)
    source = GatherCountingSource(models.tiny_mlp(seed=0))
    engine = WeightTransferTrainerFactory.trainer_init("nccl", {}, LOCAL, client=client, source=source)
    tensors = len(source.metadata())
    with pytest.raises(RuntimeError, match="HTTP 409|NCCL error|HTTP 500"):
        engine.send_weights("v1")
    assert source.gathers == tensors
    monkeypatch.setattr(NCCLTrainerWeightTransferEngine, "broadcast_fails_after", None)
    engine.client = engine.inner.client = RecordingClient()
    engine.send_weights("v2")  # the next round is a whole pass again
    assert source.gathers == 2 * tensors


def test_ipc_defaults_to_vllms_unpacked_handles_and_nccl_to_packed(fake_vllm):
    source = ModuleSource(models.tiny_mlp(seed=0))
    ipc = WeightTransferTrainerFactory.trainer_init("ipc", {}, {"rank": 0}, client=RecordingClient(), source=source)
    nccl = WeightTransferTrainerFactory.trainer_init("nccl", {}, LOCAL, client=RecordingClient(), source=source)
    assert (ipc.inner.init_info.packed, nccl.inner.init_info.packed) == (False, True)


def test_ipc_over_http_is_refused_before_any_call_naming_ray_actors(fake_vllm):
    from wt_callbacks.transfer import HTTPVLLMWeightSyncClient

    client = HTTPVLLMWeightSyncClient("http://127.0.0.1:9", timeout=1)  # never reached
    with pytest.raises(ValueError, match=r"'ipc' cannot send its CUDA IPC handles over HTTP .*ray_actors:"):
        WeightTransferTrainerFactory.trainer_init("ipc", {}, {"rank": 0}, client=client, source=ModuleSource(models.tiny_mlp(seed=0)))


def test_released_call_form_with_this_projects_init_info(fake_vllm):
    from wt_callbacks.transfer.backends.vllm_native import IPCTrainerInitInfo, NCCLTrainerInitInfo

    source = ModuleSource(models.tiny_mlp(seed=0))
    nccl = WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo(**LOCAL, world_size=3), client=RecordingClient(), source=source)
    ipc = WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(rank=1), client=RecordingClient(), source=source)
    assert (type(nccl).__name__, nccl.inner.init_info.world_size) == ("NCCLTrainerWeightTransferEngine", 3)
    assert (type(ipc).__name__, ipc.inner.init_info.rank) == ("IPCTrainerWeightTransferEngine", 1)
