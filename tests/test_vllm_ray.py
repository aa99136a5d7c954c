"""vLLM's ``LLM`` in Ray actors on a second Ray node, synced by a trainer that has no vLLM.

A Ray cluster of the test's own (``tests/support/ray_cluster.py``) spans two
hosts (two network namespaces, ``tests/support/netns.py``): its head on this
host, where the trainer (a process of the project venv) joins as a driver,
and a worker node on the other host, offering a resource only it has. Two engines,
vLLM's own ``LLM`` with the ``torch_dist`` weight-transfer config, are
deployed there from the vLLM venv as named actors (``python -m
wt_callbacks.demos.vllm_ray``, as an inference deployment would); the trainer
is given their names (``ray_actors``), nothing else. After each round both
engines' greedy logprobs equal the trainer model's, for two inline rounds and
a ``commit: prepared`` one.

Skipped where the machine cannot make network namespaces, and without the
vLLM venv as the other vLLM tests are; both venvs need the same Ray
(``scripts/vllm_env.sh`` installs the project venv's).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO_ROOT
from tests.support.netns import TwoHosts, two_hosts
from tests.support.ray_cluster import RayCluster, start_ray_cluster
from wt_callbacks.demos.vllm_server import REQUIRE_VLLM_ENV

try:
    RAY_VERSION = importlib.metadata.version("ray")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("ray is not installed (the project's [ray] extra)", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FP32_ATOL = 1e-4
"""Max |logprob difference| vLLM vs transformers in float32 (measured: ~1e-6)."""
FAR_NODE = "wt_far_node"
"""The custom resource only the worker node on the other host offers."""
ENGINES = ["vllm-0", "vllm-1"]
DEPLOY_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    with two_hosts() as made:
        yield made


@pytest.fixture(scope="module")
def cluster(hosts: TwoHosts, vllm_python: Path) -> Iterator[RayCluster]:
    probe = subprocess.run(
        [str(vllm_python), "-c", "import ray; print(ray.__version__)"], capture_output=True, text=True, timeout=120
    )
    theirs = probe.stdout.strip() if probe.returncode == 0 else None
    if theirs != RAY_VERSION:
        reason = (
            f"the vLLM venv has ray {theirs or '(none)'}, this one ray {RAY_VERSION}: a driver joins only a "
            "cluster of its own Ray version; run `bash scripts/vllm_env.sh`, which installs this venv's"
        )
        if os.environ.get(REQUIRE_VLLM_ENV) == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    ray_cli = vllm_python.parent / "ray"
    made = start_ray_cluster(
        ray_cli, hosts.here, hosts.there, worker_wrapper=hosts.run_there, worker_resources={FAR_NODE: len(ENGINES)}
    )
    yield made
    made.stop()


@pytest.fixture(scope="module")
def engines(cluster: RayCluster, vllm_python: Path, vllm_model_dir: Path) -> str:
    """The engines' namespace, once both answer."""
    namespace = f"wt-{secrets.token_hex(4)}"
    deploy = subprocess.run(
        [
            str(vllm_python), "-m", "wt_callbacks.demos.vllm_ray", "--address", cluster.address,
            "--node-ip-address", cluster.head_ip, "--model", str(vllm_model_dir), "--namespace", namespace,
            "--resources", f'{{"{FAR_NODE}": 1}}', *(arg for name in ENGINES for arg in ("--name", name)),
        ],
        capture_output=True, text=True, timeout=DEPLOY_TIMEOUT_S, cwd=REPO_ROOT, env={**os.environ, **cluster.env},
    )  # fmt: skip
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-6000:]
    return namespace


def test_vllm_engines_in_ray_actors_on_another_node_serve_every_round(
    hosts: TwoHosts, cluster: RayCluster, engines: str, vllm_model_dir: Path
) -> None:
    """The trainer is a process of the project venv (``tests/support/ray_trainer_app.py``)."""
    trainer = subprocess.run(
        [
            sys.executable, "-m", "tests.support.ray_trainer_app", "--address", cluster.address,
            "--node-ip-address", cluster.head_ip, "--namespace", engines, "--model", str(vllm_model_dir),
            *(arg for name in ENGINES for arg in ("--name", name)),
        ],
        capture_output=True, text=True, timeout=DEPLOY_TIMEOUT_S, cwd=REPO_ROOT, env={**os.environ, **cluster.env},
    )  # fmt: skip
    assert trainer.returncode == 0, trainer.stdout[-3000:] + trainer.stderr[-6000:]
    report = json.loads(trainer.stdout.strip().splitlines()[-1])
    # Both engines on the worker node, the other host: the trainer advertised
    # this host's address on the link, and broadcast over gloo.
    assert report["server_hosts"] == [hosts.there] * len(ENGINES)
    assert report["master_address"] == hosts.here
    assert report["transport"] == "gloo"
    assert min(report["before"]) > 100 * FP32_ATOL, report
    assert len(report["rounds"]) == 2 and all(max(diffs) <= FP32_ATOL for diffs in report["rounds"]), report
    assert max(report["prepared_round"]) <= FP32_ATOL, report
