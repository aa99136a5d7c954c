"""What one CUDA GPU can show; every test here is marked ``gpu`` and skips without CUDA.

Run them with ``bash scripts/gpu_check.sh WHEEL_DIR`` (README, "GPU check").
Two NCCL ranks cannot share one GPU, so every trainer is a single rank, and
the receivers (CPU models in their own processes) join over gloo or the shm
ring. At world size 1 FSDP1 runs every unit as ``NO_SHARD`` (it says so), so
its sharded all-gather on CUDA needs two GPUs; the sharded paths run on two
CPU ranks in ``tests/test_sharded_sources.py`` and ``tests/test_accelerate.py``.

The framework paths that refuse a CPU run here: Lightning's ``FSDPStrategy``
and ``DeepSpeedStrategy`` (and ``ModelParallelStrategy``) with ``devices=1``,
Accelerate's FSDP plugin (versions 1 and 2) and DeepSpeed ZeRO-3 with one
process, each through the same apps the CPU tests launch. This module imports
only what a GPU machine with torch, lightning, accelerate, transformers,
pytest and requests has, plus what the GPU check installs (fastapi, uvicorn,
pydantic, deepspeed).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest
import requests
import torch
import torch.distributed as dist

from tests.support import REPO_ROOT
from tests.support.transfer import connect
from wt_callbacks.checksums import module_checksums
from wt_callbacks.demos import models
from wt_callbacks.demos.multiprocess import free_port
from wt_callbacks.demos.receiver_process import receiver_checksums
from wt_callbacks.transfer import ModuleSource

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
REQUIRED = os.environ.get("WT_REQUIRE_GPU") == "1"
"""Set by scripts/gpu_check.sh: a missing dependency fails instead of skipping."""
TIMEOUT_S = 120
WIDE = "wt_callbacks.demos.models:wide_mlp"


def need(module: str) -> None:
    if REQUIRED:
        __import__(module)
    else:
        pytest.importorskip(module)


def push(url: str, source: ModuleSource, **config) -> None:
    client, engine = connect(url, source, **config)
    try:
        engine.send_weights("v1")
    finally:
        engine.shutdown()
        client.close()


@pytest.fixture
def one_rank_group():
    """A world-size-1 NCCL default group, as a single-GPU trainer has."""
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_send_async_snapshots_cuda_parameters_into_pinned_host_memory(receiver_proc, dtype):
    """``send: async`` from a CUDA model: the snapshot is page-locked host
    memory, ``auto`` sends it over the shm ring (never NCCL), and the receiver
    gets the snapshot step's weights while the model moved on."""
    from wt_callbacks.config import SyncConfig
    from wt_callbacks.sync import WeightSync

    trainer = models.mixed_model(seed=0).cuda()
    receiver = receiver_proc("wt_callbacks.demos.models:mixed_model")
    ws = WeightSync(SyncConfig(servers=[receiver.url], send="async", dtype=dtype, timeout_s=TIMEOUT_S))
    ws.setup(trainer)
    try:
        assert ws.sync_at_fit_start(0) is not None
        assert ws._async.snapshot._buffer.is_pinned() and ws.engine.group.transport == "shm"
        via = getattr(torch, dtype) if dtype else None
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(1.0)
        ws.maybe_sync(1)
        sent = module_checksums(trainer, via_dtype=via)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(1.0)
        assert ws.sync_at_train_end(1) is not None
        assert receiver_checksums(receiver.url) == sent
    finally:
        ws.close()


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_cuda_parameters_into_the_receiver(receiver_proc, transport):
    trainer = models.mixed_model(seed=0).cuda()
    receiver = receiver_proc("wt_callbacks.demos.models:mixed_model")
    push(receiver.url, ModuleSource(trainer), transport=transport)
    assert receiver_checksums(receiver.url) == module_checksums(trainer)


def test_fsdp2_casts_before_the_gather_on_cuda(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from wt_callbacks.transfer.sources.gathering import in_wire_dtype

    model = models.wide_mlp(seed=0).cuda()
    expected = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    mesh = init_device_mesh("cuda", (1,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    weight = model.layers[0].weight
    # The shard is cast, the gather then moves bf16.
    assert isinstance(in_wire_dtype(weight.detach(), torch.bfloat16), DTensor)
    assert in_wire_dtype(weight.detach(), torch.bfloat16).to_local().dtype == torch.bfloat16
    sent = dict(ModuleSource(model, dtype=torch.bfloat16))
    assert sent.keys() == expected.keys()
    for name, tensor in sent.items():
        assert tensor.is_cuda and tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_on_cuda_into_the_receiver(one_rank_group, receiver_proc, use_orig_params):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    expected = module_checksums(models.wide_mlp(seed=0), via_dtype=torch.bfloat16)
    model = FullyShardedDataParallel(
        models.wide_mlp(seed=0).cuda(),
        auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
        device_id=torch.cuda.current_device(),
        use_orig_params=use_orig_params,
    )
    source = ModuleSource(model, dtype=torch.bfloat16)
    assert source.scheme == "fsdp1"
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for _, t in source)
    receiver = receiver_proc(WIDE)
    push(receiver.url, source, transport="shm")
    assert receiver_checksums(receiver.url) == expected


def served(url: str) -> dict:
    info = requests.get(f"{url}/weight_info", timeout=30).json()
    info["checksums"] = receiver_checksums(url)
    return info


def run_app(cmd: list[str], out, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run(
        cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel", "deepspeed_stage_3"])
def test_lightning_strategies_with_one_gpu(receiver_proc, tmp_path, strategy):
    need("lightning")
    if strategy.startswith("deepspeed"):
        need("deepspeed")
    receiver = receiver_proc()
    section = {"servers": [receiver.url], "module": "model", "every_n_train_steps": 3, "timeout_s": TIMEOUT_S,
               "dtype": "bfloat16", "config": {"transport": "shm"}}  # fmt: skip
    out = tmp_path / "result.json"
    result = run_app(
        [sys.executable, "-m", "tests.support.lightning_app", "--weight-sync", json.dumps(section),
         "--strategy", strategy, "--accelerator", "cuda", "--devices", "1", "--max-steps", "6", "--out", str(out)],
        out,
    )  # fmt: skip
    info = served(receiver.url)
    assert info["version_history"] == ["step-0", "step-3", "step-6"]
    assert info["checksums"] == result["checksums"]


@pytest.mark.parametrize("plugin", ["fsdp1", "fsdp2", "zero3"])
def test_accelerate_with_one_gpu(receiver_proc, tmp_path, plugin):
    need("accelerate")
    if plugin == "fsdp1" or plugin == "fsdp2":
        launcher = ["--use_fsdp", "--fsdp_version", plugin[-1]]
    else:
        need("deepspeed")
        config = tmp_path / "zero3.json"
        config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
                                      "zero_optimization": {"stage": 3}}))  # fmt: skip
        launcher = ["--use_deepspeed", "--deepspeed_config_file", str(config)]
    receiver = receiver_proc(WIDE)
    out = tmp_path / "result.json"
    result = run_app(
        [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--num_processes", "1", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "tests.support.accelerate_app",
         "--server", receiver.url, "--steps", "6", "--grad-accum", "2", "--every", "3", "--model", "wide_mlp",
         "--dtype", "bfloat16", "--transport", "shm", "--out", str(out)],
        out,
    )  # fmt: skip
    assert result["scheme"] == {"fsdp1": "fsdp1", "fsdp2": "fsdp2", "zero3": "zero3"}[plugin]
    info = served(receiver.url)
    assert info["version_history"] == ["step-0", "step-3", "step-6"]
    assert info["checksums"] == result["checksums"]
