"""ModuleSource over FSDP1 and DeepSpeed (ZeRO-2, ZeRO-3) models, on two real ranks.

What a sharded model sends must be what the same model sends unwrapped
(names, dtypes, shapes, strides, bits; a bf16 wire included) and, for a
transformers model, what ``save_pretrained`` writes (Qwen3-MoE's packed
experts go per expert). ``metadata()`` never communicates. A scheme that
cannot be sent fails at construction, naming the fix.

Lightning's ``FSDPStrategy`` ("requires a GPU accelerator") and
``DeepSpeedStrategy`` ("only supported on CUDA GPUs") refuse a CPU, so the
models here are wrapped the way those strategies wrap them: FSDP1 around the
whole module (``FullyShardedDataParallel(module, device_id=cpu)``; FSDP1
itself needs ``device_id`` on a CPU), DeepSpeed's engine from
``deepspeed.initialize`` over a gloo group. ``tests/test_gpu.py`` runs the
framework paths on a GPU.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch import nn

from wt_callbacks.demos.full_weights import full_state
from wt_callbacks.demos import models
from wt_callbacks.demos.multiprocess import free_port, leave_group_together
from wt_callbacks.demos.tiny_lms import TINY_LMS
from wt_callbacks.transfer import ModuleSource

pytestmark = pytest.mark.slow
TIMEOUT = datetime.timedelta(seconds=120)


class SharingPolicy(nn.Module):
    """A reference embedding registered before the served model shares its
    weight: the tensor's first path lies outside ``.model``, its path inside
    names it when ``.model`` is sent."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.reference = nn.Embedding(300, 48)
        self.model = models.mixed_model(seed=0)
        self.model.embed.weight = self.reference.weight


class Policy(nn.Module):
    """A policy as a LightningModule holds it: the served model at ``.model``, a value head beside it."""

    def __init__(self, contiguous: bool = False) -> None:
        super().__init__()
        self.model = models.mixed_model(seed=0)
        if contiguous:  # DeepSpeed broadcasts parameters as bytes: it needs them contiguous
            self.model.transposed = nn.Parameter(self.model.transposed.detach().contiguous())
        torch.manual_seed(1)
        self.value_head = nn.Linear(48, 1)


def without_collectives(fn):
    """Run ``fn`` with every torch.distributed collective raising."""
    names = ["all_gather", "all_gather_into_tensor", "broadcast", "all_reduce", "reduce_scatter_tensor", "barrier"]
    saved = {name: getattr(dist, name) for name in names}

    def refuse(*args, **kwargs):
        raise AssertionError("metadata() ran a collective")

    try:
        for name in names:
            setattr(dist, name, refuse)
        return fn()
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def assert_sends_like(sharded: nn.Module, plain: nn.Module) -> None:
    """``ModuleSource(sharded)`` sends what ``ModuleSource(plain)`` sends, for
    the whole module and for a selection, on an fp32 and a bf16 wire. Rank 0
    iterates the source; the other ranks only join its gathers
    (``gather_only``), as ranks that do not send do: a collective they
    skipped or added would hang the pass or garble rank 0's tensors."""
    for selection in ({}, {"submodule": "model", "exclude": ["*.bias"]}):
        for dtype in (None, torch.bfloat16):
            source = ModuleSource(sharded, dtype=dtype, **selection)
            expected = ModuleSource(plain, dtype=dtype, **selection)
            metas = without_collectives(source.metadata)
            assert {m.name: m for m in metas} == {m.name: m for m in expected.metadata()}, selection
            if dist.get_rank() != 0:
                assert list(source.gather_only()), selection
                continue
            sent = list(source)
            assert [n for n, _ in sent] == [m.name for m in metas]
            reference = dict(expected)
            for name, tensor in sent:
                want = reference[name]
                assert tensor.dtype == want.dtype and torch.equal(tensor, want), (name, dtype)
                assert tensor.stride() == want.stride(), name


def assert_sends_checkpoint(sharded: nn.Module, checkpoint_dir: str, *, also: tuple[str, ...] = ()) -> None:
    """``ModuleSource(sharded)`` sends the tensors of the checkpoint
    ``save_pretrained`` wrote to ``checkpoint_dir`` (plus ``also``)."""
    saved = {}
    for file in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        saved.update(load_file(file))
    sent = dict(ModuleSource(sharded))
    assert set(sent) == set(saved) | set(also), sorted(set(sent) ^ set(saved))
    for name, tensor in saved.items():
        assert torch.equal(sent[name], tensor), name


def message_of(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError")


def _finish(rank: int, out_dir: str, out: dict) -> None:
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(out))
    leave_group_together()


# --------------------------------------------------------------------------- #
# FSDP1
# --------------------------------------------------------------------------- #


def fsdp1(module: nn.Module, use_orig_params: bool, units=(nn.Linear,), **options) -> nn.Module:
    """FSDP1 around ``module``, with a unit for each submodule of a class in
    ``units`` and for each submodule listed there (``options``: more
    ``FullyShardedDataParallel`` arguments)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import CustomPolicy

    classes = tuple(u for u in units if isinstance(u, type))
    instances = [u for u in units if not isinstance(u, type)]
    return FullyShardedDataParallel(
        module,
        auto_wrap_policy=CustomPolicy(lambda m: isinstance(m, classes) or any(m is u for u in instances)),
        device_id=torch.device("cpu"),
        use_orig_params=use_orig_params,
        **options,
    )


def _fsdp1_rank(rank: int, port: int, out_dir: str, checkpoints: dict[str, str]) -> None:
    from torch.distributed.fsdp import CPUOffload, fully_shard
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=TIMEOUT)
    out: dict = {}
    try:
        for orig in (False, True):
            # The root unit wraps the whole policy, as FSDPStrategy wraps the LightningModule.
            wrapped = fsdp1(Policy(), orig)
            assert ModuleSource(wrapped).scheme == "fsdp1"
            assert_sends_like(wrapped, Policy())
            assert_sends_like(fsdp1(SharingPolicy(), orig), SharingPolicy())

            qwen = fsdp1(TINY_LMS["qwen3_moe"](seed=0), orig, units=(Qwen3MoeDecoderLayer,))
            assert_sends_checkpoint(qwen, checkpoints["qwen3_moe"])

            # lm_head in a unit of its own, its weight tied to the embedding in the root unit.
            llama = TINY_LMS["llama_tied"](seed=0)
            tied = fsdp1(llama, orig, units=(LlamaDecoderLayer, llama.lm_head))
            assert_sends_checkpoint(tied, checkpoints["llama_tied"], also=() if orig else ("lm_head.weight",))

            # CPU offload: the shards live on the CPU and move to the compute device to be gathered.
            # (summon_full_params itself refuses to run here without an accelerator.)
            offloaded = fsdp1(Policy(), orig, cpu_offload=CPUOffload(offload_params=True))
            assert_sends_like(offloaded, Policy())

            # Lightning's pl_module / Accelerate's unwrap_model(model): the root unit is outside.
            out[f"inner-{orig}"] = message_of(lambda: ModuleSource(wrapped.module))
        mixed = nn.Module()
        mixed.a = fsdp1(nn.Sequential(nn.Linear(4, 4)), False)
        mixed.b = fully_shard(nn.Linear(4, 4))
        out["mixed"] = message_of(lambda: ModuleSource(mixed))
    finally:
        _finish(rank, out_dir, out)


def test_fsdp1_sends_what_the_unwrapped_model_sends(tmp_path):
    checkpoints = {}
    for family in ("qwen3_moe", "llama_tied"):
        checkpoints[family] = str(tmp_path / family)
        TINY_LMS[family](seed=0).save_pretrained(checkpoints[family])
    mp.spawn(_fsdp1_rank, args=(free_port(), str(tmp_path), checkpoints), nprocs=2, join=True)
    out = json.loads((tmp_path / "result.json").read_text())
    for orig, name in ((False, "_flat_param"), (True, "model.transposed")):
        assert out[f"inner-{orig}"].startswith(
            f"parameter {name!r} is an FSDP1 flat shard whose FullyShardedDataParallel unit is outside the "
            "module given (Policy): pass the module holding the FSDP root (Lightning: trainer.strategy.model; "
            "Accelerate: the model accelerator.prepare returned"
        )
    assert out["mixed"] == (
        "the module mixes sharding schemes: FSDP1 (FullyShardedDataParallel) (unit 'a') and DTensor "
        "(FSDP2 fully_shard / tensor parallel) (fully_shard module 'b'). Shard it with one scheme, or send a "
        "part that uses one (module: ...)"
    )


# --------------------------------------------------------------------------- #
# DeepSpeed
# --------------------------------------------------------------------------- #


def deepspeed_engine(module: nn.Module, stage: int, **zero) -> nn.Module:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage, **zero},
        # torch's AdamW: DeepSpeed's own would JIT-build an op.
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    # The optimizer takes what trains: a PEFT model's frozen base stays out.
    trainable = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=trainable)
    return engine


def _deepspeed_rank(rank: int, port: int, out_dir: str, checkpoints: dict[str, str]) -> None:
    from wt_callbacks.demos.deepspeed_cpu import skip_shm_comm_op
    from wt_callbacks.transfer.sources.zero3 import Zero3Groups

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    skip_shm_comm_op()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=TIMEOUT)
    out: dict = {}
    try:
        # Every parameter partitioned, even the small ones.
        zero3 = deepspeed_engine(Policy(contiguous=True).float(), 3, stage3_param_persistence_threshold=0)
        assert ModuleSource(zero3).scheme == "zero3"
        assert all(p.numel() == 0 for p in zero3.parameters())
        assert_sends_like(zero3, Policy(contiguous=True).float())

        # Groups are sized from ds_numel (numel() is 0): at most group_bytes plus one parameter.
        small = Zero3Groups(zero3, group_bytes=8192)
        names = [m.name for m in small.parameters()]
        sizes = {m.name: m.nbytes for m in small.parameters()}
        groups = small.groups(names)
        assert len(groups) > 1 and sum(groups, []) == names
        assert all(sum(sizes[n] for n in g[:-1]) <= 8192 for g in groups)
        reference = full_state(zero3)
        for name, tensor in small.gather(names, None):
            assert torch.equal(tensor, reference[name.removeprefix("module.")]), name

        # Default persistence: after a step the biases (below the threshold) are whole on every rank.
        trained = deepspeed_engine(models.wide_mlp(seed=0), 3)
        trained.backward(trained(torch.randn(2, 512)).pow(2).mean())
        trained.step()
        shapes = {n: tuple(p.shape) for n, p in trained.named_parameters()}
        assert shapes["module.layers.0.bias"] == (512,) and shapes["module.layers.0.weight"] == (0,)
        reference = full_state(trained)
        sent = dict(ModuleSource(trained))
        assert sent.keys() == reference.keys()
        assert all(torch.equal(t, reference[n]) for n, t in sent.items())

        zero2 = deepspeed_engine(Policy(contiguous=True).float(), 2)
        assert ModuleSource(zero2).scheme == "local"
        assert_sends_like(zero2, Policy(contiguous=True).float())

        qwen = deepspeed_engine(TINY_LMS["qwen3_moe"](seed=0), 3, stage3_param_persistence_threshold=0)
        assert_sends_checkpoint(qwen, checkpoints["qwen3_moe"])

        # NVMe offload cannot run here (DeepSpeed needs libaio for it): mark one
        # real partition as DeepSpeed marks one it swapped to NVMe.
        partition = next(zero3.parameters()).ds_tensor
        partition.final_location = "nvme"
        out["nvme"] = message_of(lambda: ModuleSource(zero3))
        partition.final_location = None

        from deepspeed.module_inject.layers import LinearAllreduce
        from deepspeed.pipe import PipelineModule

        out["pipeline"] = message_of(lambda: ModuleSource(PipelineModule([nn.Linear(4, 4), nn.Linear(4, 4)], num_stages=2)))
        out["autotp"] = message_of(lambda: ModuleSource(nn.Sequential(LinearAllreduce(nn.Linear(4, 4), dist.group.WORLD))))
        mixed = nn.Module()
        mixed.policy = zero3.module
        mixed.head = fsdp1(nn.Sequential(nn.Linear(4, 4)), False)
        out["mixed"] = message_of(lambda: ModuleSource(mixed))
    finally:
        _finish(rank, out_dir, out)


def test_deepspeed_sends_what_the_unwrapped_model_sends(tmp_path):
    pytest.importorskip("deepspeed")
    from wt_callbacks.demos.deepspeed_cpu import shm_files

    checkpoint = str(tmp_path / "qwen3_moe")
    TINY_LMS["qwen3_moe"](seed=0).save_pretrained(checkpoint)
    before = shm_files()
    mp.spawn(_deepspeed_rank, args=(free_port(), str(tmp_path), {"qwen3_moe": checkpoint}), nprocs=2, join=True)
    assert shm_files() == before
    out = json.loads((tmp_path / "result.json").read_text())
    assert out["nvme"].startswith(
        "DeepSpeed ZeRO-3 keeps 'model.transposed' on NVMe (offload_param device: nvme): weight sync "
        "gathers groups of parameters, more at once than DeepSpeed's NVMe swapper holds. Use offload_param "
        "device: cpu"
    )
    assert out["pipeline"].startswith("the module is a DeepSpeed PipelineModule: each rank holds only its pipeline stage")
    assert out["autotp"].startswith("'0' is a DeepSpeed tensor-parallel layer (LinearAllreduce, AutoTP)")
    assert out["mixed"].startswith(
        "the module mixes sharding schemes: FSDP1 (FullyShardedDataParallel) (unit 'head') and DeepSpeed ZeRO-3 "
        "(parameter 'policy.model.transposed')"
    )
