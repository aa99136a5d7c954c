"""A Ray cluster of the test's own across two hosts: the head here, a worker node on the other host.

Both nodes are ``ray start --block`` of the vLLM venv's Ray, so every worker
process they spawn (the actors hosting vLLM) runs the vLLM venv's python;
this process (the trainer, the project venv, no vLLM) joins as a driver,
which works when both venvs have the same Ray. The cluster has a token of its
own (Ray's token authentication), every port the head opens on this host is
a free one (other clusters may run here), and its files live in a temporary
directory. Each node runs in a session of its own, and ``stop`` ends every
process of those sessions: the nodes, their workers, and vLLM's engine
processes below them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from wt_callbacks.demos.multiprocess import free_port

NODE_TIMEOUT_S = 60.0
OBJECT_STORE_BYTES = 128 * 1024 * 1024
STOP_GRACE_S = 5.0
"""How long the nodes get to end after SIGTERM (vLLM's engines do not all heed it) before SIGKILL."""


@dataclass
class RayCluster:
    address: str
    """The head's ``host:port`` (``ray.init(address=...)``)."""
    head_ip: str
    env: dict[str, str]
    """What a process joining it needs in its environment (the token)."""
    temp_dir: Path
    nodes: list[subprocess.Popen] = field(default_factory=list)

    def stop(self) -> None:
        sessions = {node.pid for node in self.nodes}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = _session_members(sessions)
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + STOP_GRACE_S
            while _session_members(sessions) and time.monotonic() < deadline:
                time.sleep(0.2)
        for node in self.nodes:
            node.wait(timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _session_members(sessions: set[int]) -> list[int]:
    """Live processes in ``sessions`` (the field after the command in /proc/PID/stat is the session id)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) in sessions:
            members.append(int(entry))
    return members


STARTED = "Ray runtime started."
"""What ``ray start`` prints once its node is in the cluster."""


def _wait_until_started(node: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + NODE_TIMEOUT_S
    while STARTED not in log.read_text(errors="replace"):
        if node.poll() is not None:
            raise RuntimeError(f"a Ray node exited with status {node.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"a Ray node did not start within {NODE_TIMEOUT_S:g} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def start_ray_cluster(
    ray_cli: Path,
    head_ip: str,
    worker_ip: str,
    *,
    worker_wrapper: Sequence[str],
    worker_resources: Mapping[str, float],
    worker_cpus: int = 2,
) -> RayCluster:
    """Start the head on ``head_ip`` (this host) and a worker node on
    ``worker_ip`` (run through ``worker_wrapper``, e.g. ``ip netns exec``)
    offering ``worker_resources``; wait until both are in the cluster."""
    temp_dir = Path(tempfile.mkdtemp(prefix="wtray-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    env = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    port = free_port()
    cluster = RayCluster(f"{head_ip}:{port}", head_ip, env, temp_dir)
    # The object store is allocated as used; its limit only keeps it small.
    common = ["--block", "--disable-usage-stats", "--object-store-memory", str(OBJECT_STORE_BYTES)]
    head = [
        str(ray_cli), "start", "--head", *common, "--node-ip-address", head_ip, "--port", str(port),
        "--num-cpus", "0", "--include-dashboard", "false", "--temp-dir", str(temp_dir / "head"),
        "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
        "--dashboard-agent-grpc-port", str(free_port()), "--metrics-export-port", str(free_port()),
        "--runtime-env-agent-port", str(free_port()), "--node-manager-port", str(free_port()),
        "--object-manager-port", str(free_port()),
    ]  # fmt: skip
    worker = [
        *worker_wrapper, str(ray_cli), "start", *common, "--address", cluster.address,
        "--node-ip-address", worker_ip, "--num-cpus", str(worker_cpus), "--resources",
        json.dumps(dict(worker_resources)), "--temp-dir", str(temp_dir / "worker"),
    ]  # fmt: skip
    try:
        for cmd, log in ((head, temp_dir / "head.log"), (worker, temp_dir / "worker.log")):
            with open(log, "wb") as out:
                node = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env={**os.environ, **env}, start_new_session=True,
                )  # fmt: skip
            cluster.nodes.append(node)
            _wait_until_started(node, log)
    except BaseException:
        cluster.stop()
        raise
    return cluster
