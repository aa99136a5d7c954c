"""Ray actors hosting the worker engine, driven by RayVLLMWeightSyncClient;
and a trainer whose ranks are Ray actors, as vLLM's RL examples run one."""

from __future__ import annotations

import datetime
import os

import pytest
import torch

from wt_callbacks.checksums import module_checksums
from wt_callbacks.demos import models
from wt_callbacks.demos.multiprocess import free_port, leave_group_together
from wt_callbacks.receiver import RayReceiver
from wt_callbacks.transfer import ModuleSource, RayVLLMWeightSyncClient, WeightTransferTrainerFactory
from wt_callbacks.transfer.backends.torch_dist import TorchDistTrainerInitInfo

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        namespace="wt-tests",
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    yield
    ray.shutdown()


def test_two_named_actors_receive_one_round(ray_cluster):
    actor_cls = ray.remote(num_cpus=0)(RayReceiver)
    actors = [
        actor_cls.options(name=f"receiver-{i}").remote(models.tiny_mlp(), dtype=None) for i in range(2)
    ]
    model = models.tiny_mlp(seed=0)
    # By name, as a YAML config would list them.
    client = RayVLLMWeightSyncClient(["receiver-0", "receiver-1"], timeout=60)
    assert client.get_world_size() == 2
    # vLLM's own client's habit (one init info for every actor) is told what differs here.
    with pytest.raises(ValueError, match=r"world_size=2 does not match the servers.* pass shared_group=True"):
        client.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2})
    engine = WeightTransferTrainerFactory.trainer_init(
        "torch_dist",
        {"timeout_s": 60, "dtype": "bfloat16"},
        {"master_address": "127.0.0.1", "master_port": 0, "rank": 0},
        client=client,
        source=ModuleSource(model),
    )
    try:
        with torch.no_grad():
            model.layers[0].weight.mul_(3)
        engine.send_weights("ray-1")
    finally:
        engine.shutdown()
    expected = module_checksums(model, via_dtype=torch.bfloat16)
    for actor in actors:
        assert ray.get(actor.weight_checksums.remote(), timeout=60)["checksums"] == expected
        info = ray.get(actor.weight_info.remote(), timeout=60)
        assert info["weight_version"] == "ray-1" and info["version_history"] == ["ray-1"]
    for actor in actors:
        ray.kill(actor)


class FSDP2TrainerRank:
    """One rank of an FSDP2 trainer in a Ray actor, written as vLLM's RL
    examples write their trainer actors: its own gloo group, the model
    ``fully_shard``-ed over a CPU mesh, and the released trainer API
    (``trainer_init(init_info, client=, source=)``, ``send_weights()``)."""

    def __init__(self, rank: int, world_size: int, group_port: int) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(group_port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
        self.rank = rank
        self.model = models.tiny_mlp(seed=0)
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def trainer_init(self, receiver) -> None:
        # master_port=0: rank 0's store takes a port free when it listens. A
        # port picked free beforehand (free_port) was taken by another
        # process before the store listened, once in CI (EADDRINUSE).
        init_info = TorchDistTrainerInitInfo(
            master_address="127.0.0.1", master_port=0, world_size=2, packed=True, rank=self.rank
        )
        self.engine = WeightTransferTrainerFactory.trainer_init(
            init_info, client=RayVLLMWeightSyncClient(receiver, timeout=60), source=ModuleSource(self.model)
        )

    def train_step(self) -> None:
        torch.manual_seed(self.rank)
        self.model(torch.randn(8, 64)).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def send_weights(self) -> None:
        self.engine.send_weights()

    def checksums(self) -> dict[str, str]:
        return module_checksums(self.model)  # gathers: every rank calls it

    def shutdown(self) -> None:
        self.engine.shutdown()
        leave_group_together()


def test_fsdp2_trainer_whose_ranks_are_ray_actors(ray_cluster):
    """Two FSDP2 ranks, each a Ray actor, push into a receiver actor: every
    rank runs the gathers, rank 0 alone talks to the receiver, which ends up
    holding the trainer's full weights, round after round."""
    receiver = ray.remote(num_cpus=0)(RayReceiver).remote(models.tiny_mlp(), dtype=None)
    rank_cls = ray.remote(num_cpus=1)(FSDP2TrainerRank)
    group_port = free_port()
    ranks = [rank_cls.remote(rank, 2, group_port) for rank in range(2)]
    try:
        ray.get([r.trainer_init.remote(receiver) for r in ranks], timeout=120)
        for version in ("rl-1", "rl-2"):
            ray.get([r.train_step.remote() for r in ranks], timeout=60)
            ray.get([r.send_weights.remote() for r in ranks], timeout=120)
            ray.get(receiver.update_weight_version.remote(version), timeout=60)
            trainer_sums = ray.get([r.checksums.remote() for r in ranks], timeout=60)
            assert trainer_sums[0] == trainer_sums[1]
            assert ray.get(receiver.weight_checksums.remote(), timeout=60)["checksums"] == trainer_sums[0], version
            assert ray.get(receiver.weight_info.remote(), timeout=60)["weight_version"] == version
        ray.get([r.shutdown.remote() for r in ranks], timeout=60)
        RayVLLMWeightSyncClient(receiver, timeout=60).shutdown_weight_transfer_engine()  # vLLM's client has it too
    finally:
        for actor in [*ranks, receiver]:
            ray.kill(actor)
