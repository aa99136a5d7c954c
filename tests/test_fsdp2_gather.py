"""FSDP2 parameters gathered a bucket at a time are exactly ``full_tensor()``.

Two spawned gloo ranks, rank 1 only joining the gathers (``gather_only``,
what a rank that does not send runs); odd row counts make shards uneven, and a one-row
tensor leaves rank 1 no rows. Parameters sharded by ``fully_shard``, plus ``distribute_tensor``
placements the bucketed gather leaves to ``full_tensor()`` (``Shard(1)``,
``Replicate``, a 2-D mesh) and a plain parameter beside them; small buckets
so that buckets hold several tensors, split between tensors or within one
(a tensor larger than a bucket goes in pieces of rows). Then a transformers
MoE model through ``ModuleSource``: the checkpoint-format conversion and
include / exclude work on the bucketed gather's tensors as on a whole model.
"""

from __future__ import annotations

import datetime
import itertools
import os
import tempfile
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wt_callbacks.demos.multiprocess import free_port, leave_group_together
from wt_callbacks.demos.tiny_lms import qwen3_moe
from wt_callbacks.transfer import ModuleSource, materialize_full_tensor
from wt_callbacks.transfer.sources.fsdp2 import FSDP2Shards
from wt_callbacks.transfer.sources.schemes import gather_for


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.odd = torch.nn.Linear(7, 5)  # 5 rows: uneven on 2 and 3 ranks
    model.tiny = torch.nn.Linear(3, 1)  # 1 row: the other ranks hold none
    model.big = torch.nn.Linear(16, 64, bias=False)  # larger than one small bucket
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.randn(6))
    model.low = torch.nn.Linear(4, 9).to(torch.bfloat16)
    return model


def _sharded_placements(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for layer in (model.odd, model.tiny, model.big, model.low):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.cols = torch.nn.Parameter(distribute_tensor(torch.randn(4, 10), mesh, [Shard(1)]))
    model.replicated = torch.nn.Parameter(distribute_tensor(torch.randn(3, 2), mesh, [Replicate()]))
    model.plain = torch.nn.Parameter(torch.randn(2, 3))
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    model.hsdp = torch.nn.Parameter(distribute_tensor(torch.randn(5, 3), mesh2, [Replicate(), Shard(0)]))
    assert gather_for(model).scheme == "fsdp2"
    expected = {n: materialize_full_tensor(p.detach()) for n, p in model.named_parameters()}
    names = [m.name for m in FSDP2Shards(model).parameters()]
    results = {}
    for dtype, bucket in itertools.product((None, torch.bfloat16), (200, 4096, None)):
        # Rank 0 gathers the tensors; the others only join the gathers, as
        # ranks that do not send do: any collective they skipped or added
        # would hang the pass or garble rank 0's tensors.
        if bucket is None:  # the default bucket, through the public source
            source = ModuleSource(model, dtype=dtype)
            run = (lambda source=source: list(source)) if rank == 0 else source.gather_only
        else:
            gather = FSDP2Shards(model, bucket_bytes=bucket)
            run = partial(gather.gather if rank == 0 else gather.gather_only, names, dtype)
        for round_ in range(2):  # the second round reuses the scratch buffers
            got = list(run())
            if rank != 0:
                assert got == names, "gather_only must yield every name, in the order of parameters()"
                continue
            assert [n for n, _ in got] == names, "order must follow parameters()"
            for name, tensor in got:
                want = expected[name]
                if dtype is not None and want.is_floating_point():
                    want = want.to(dtype)
                results[(str(dtype), bucket, round_, name)] = (
                    tensor.dtype == want.dtype and tensor.shape == want.shape and torch.equal(tensor, want)
                )
    return results


def _checkpoint_format(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    whole = qwen3_moe(seed=3)
    model = qwen3_moe(seed=3)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    results = {}
    for dtype, exclude in ((None, ()), (torch.bfloat16, ("*.experts.1.*", "lm_head.*"))):
        want = list(ModuleSource(whole, dtype=dtype, exclude=exclude))
        source = ModuleSource(model, dtype=dtype, exclude=exclude)
        got = list(source)
        results[("names", str(dtype))] = [n for n, _ in got] == [n for n, _ in want] == [
            m.name for m in source.metadata()
        ]
        for (name, tensor), (_, expected) in zip(got, want):
            results[(str(dtype), name)] = tensor.dtype == expected.dtype and torch.equal(tensor, expected)
    return results


def _held_unsharded_or_sharded_late(rank: int, world: int) -> dict:
    """What a source sends is the weights whatever state FSDP2 is in: after a
    forward without a backward under ``reshard_after_forward=False`` (bf16
    compute copies registered as the parameters: they were sent, and
    described as bf16), and for a source built before ``fully_shard`` (it
    kept treating the DTensors as whole tensors and failed the round)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model()
    early = ModuleSource(model)
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in (model.odd, model.big):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    x = torch.randn(3, 7)
    model.odd(x).float().sum().backward()  # a training step's backward: resharded after it
    weights = {n: materialize_full_tensor(p.detach()) for n, p in model.named_parameters()}
    with torch.no_grad():
        model.odd(x)  # validation: the unsharded bf16 copies stay registered
    assert any(p.dtype == torch.bfloat16 and not hasattr(p, "full_tensor") for p in model.odd.parameters())
    results = {}
    for label, source in (("built before fully_shard", early), ("built after the forward", ModuleSource(model))):
        sent = list(source)
        results[(label, "metadata")] = {m.name: m.dtype for m in source.metadata()} == {n: w.dtype for n, w in weights.items()}
        for name, tensor in sent:
            results[(label, name)] = tensor.dtype == weights[name].dtype and torch.equal(tensor, weights[name])
    return results


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        results = _sharded_placements(rank, world)
        results.update(_checkpoint_format(rank, world))
        results.update(_held_unsharded_or_sharded_late(rank, world))
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "results.pt"))
    finally:
        leave_group_together()


def test_bucketed_gather_equals_full_tensor():
    world = 2
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(world, free_port(), out_dir), nprocs=world, join=True, start_method="spawn")
        results = torch.load(os.path.join(out_dir, "results.pt"))
    wrong = sorted(str(k) for k, ok in results.items() if not ok)
    assert not wrong, f"differ from full_tensor() / the whole model: {wrong}"
    assert len(results) >= 2 * 3 * 2 * 9
    assert any("experts.0.up_proj" in str(k) for k in results), "the MoE model's experts were not sent per expert"
    assert not any("experts.1." in str(k) and "bfloat16" in str(k) for k in results), "exclude was ignored"
    assert sum("built before fully_shard" in str(k) for k in results) == 1 + len(dict(_model().named_parameters()))


def test_bucket_bytes_must_be_positive():
    with pytest.raises(ValueError, match="bucket_bytes=0 must be a positive integer"):
        FSDP2Shards(torch.nn.Linear(2, 2), bucket_bytes=0)
