"""Ray actors hosting the worker engine, driven by RayVLLMWeightSyncClient."""

from __future__ import annotations

import pytest
import torch

from wt_callbacks.checksums import module_checksums
from wt_callbacks.demos import models
from wt_callbacks.receiver import RayReceiver
from wt_callbacks.transfer import ModuleSource, RayVLLMWeightSyncClient, WeightTransferTrainerFactory

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
