"""Real vLLM servers in the tests: started with bounded waits, failing the test with the log tail."""

from __future__ import annotations

import copy
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.transfer import connect
from wt_callbacks.checksums import served_checksums
from wt_callbacks.demos.multiprocess import free_port
from wt_callbacks.demos.vllm_server import (
    REQUIRE_VLLM_ENV,
    VLLMServer,
    VLLMStartError,
    find_vllm_python,
    start_vllm_server,
)
from wt_callbacks.transfer import ModuleSource, WeightSource, WeightSyncHTTPError


def vllm_python_or_skip() -> Path:
    """The vLLM venv's python; skips the test without one, fails it under ``WT_REQUIRE_VLLM=1`` (CI)."""
    python, reason = find_vllm_python()
    if python is None:
        if os.environ.get(REQUIRE_VLLM_ENV) == "1":
            pytest.fail(f"{reason} ({REQUIRE_VLLM_ENV}=1: the real-vLLM tests must run)")
        pytest.skip(reason)
    return python


def missing_vllm_internals(python: Path, module: str) -> list[str]:
    """What ``wt_callbacks.integrations.<module>.missing_vllm_internals()`` reports
    in the vLLM venv: the vLLM internals that plugin part leans on and no longer finds."""
    import json
    import subprocess

    code = f"import json; from wt_callbacks.integrations.{module} import missing_vllm_internals as m; print('missing:', json.dumps(m()))"
    probe = subprocess.run([str(python), "-c", code], cwd="/", capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-5000:]
    (line,) = [line for line in probe.stdout.splitlines() if line.startswith("missing: ")]
    return json.loads(line.removeprefix("missing: "))


@contextmanager
def running_server(python: Path, model_dir: Path, log_path: Path, **kwargs: object) -> Iterator[VLLMServer]:
    try:
        server = start_vllm_server(python, model_dir, log_path, **kwargs)  # type: ignore[arg-type]
    except VLLMStartError as e:
        pytest.fail(str(e))
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Deployment:
    """A server of the topology a test module claims, and what each of its
    workers served as loaded from its checkpoint, before any round
    (``served_checksums``): a round that syncs the checkpoint's weights back
    must leave every worker serving exactly that."""

    server: VLLMServer
    loaded: dict[str, dict[str, str]]


@contextmanager
def deployment(python: Path, model_dir: Path, log_path: Path, **topology: int) -> Iterator[Deployment]:
    """``running_server`` with ``topology`` (``tensor_parallel_size=2``, ...)."""
    with running_server(python, model_dir, log_path, **topology) as server:
        yield Deployment(server, served_checksums(server.url, api_key=server.api_key))


def checkpoint_model(server: VLLMServer) -> torch.nn.Module:
    """The checkpoint ``server`` loaded, loaded by the trainer (fp32, transformers)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32).eval()


def push(server: VLLMServer, source: torch.nn.Module | WeightSource, version: str = "v", **send: Any) -> None:
    """One round into ``server`` through the public API (``trainer_init``,
    ``send_weights(version, **send)``), both ends shut down afterwards; raises
    what the round raised."""
    client, engine = connect(
        server.url, source if isinstance(source, WeightSource) else ModuleSource(source), api_key=server.api_key
    )
    try:
        engine.send_weights(version, **send)
    finally:
        engine.shutdown()
        try:
            client.shutdown_weight_transfer_engine()
        except WeightSyncHTTPError:
            pass  # a failed round may have left the group already
        client.close()


def bf16_rounded(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose weights went through bfloat16 and back (what a bf16 wire delivers)."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return rounded


SHARED_API_KEY = "shared-vllm-s3cret"
"""The token of the session's shared server (``VLLM_API_KEY`` + our auth
middleware): the fault and stranger tests need auth on, and every other test
simply sends the key."""


SHARED_ENV = {"WT_STAGING_MEMORY": "mapped"}
"""The shared server receives the rounds it holds whole in mapped memory;
the servers of the other topologies (TP, DP, PP, other hosts, Ray) in the
heap, the default."""


class SharedVLLMServer:
    """One fp32 vLLM server for the whole test session (a start costs 30-60 s).

    ``current`` is the running server, started on first use and again after a
    test killed or stopped it, always on the same port (same URL): a fault
    test may kill it and leave the restart to whoever needs it next.
    """

    def __init__(self, python: Path, model_dir: Path, log_dir: Path) -> None:
        self.python, self.model_dir, self.log_dir = python, model_dir, log_dir
        self.port = free_port()
        self._server: VLLMServer | None = None
        self._starts = 0

    @property
    def current(self) -> VLLMServer:
        if self._server is None or self._server.proc.poll() is not None:
            self.start()
        assert self._server is not None
        return self._server

    def start(self) -> VLLMServer:
        """A fresh server on the port (the previous one stopped first, if any)."""
        self.stop()
        self._starts += 1
        log = self.log_dir / f"shared-{self._starts}.log"
        try:
            self._server = start_vllm_server(
                self.python, self.model_dir, log, port=self.port, api_key=SHARED_API_KEY, extra_env=SHARED_ENV
            )
        except VLLMStartError as e:
            pytest.fail(str(e))
        return self._server

    def signal(self, sig: int) -> None:
        """The whole server (API process, engine core, worker: its own process group)."""
        if self._server is not None and self._server.proc.poll() is None:
            os.killpg(self._server.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL, as a crashed or preempted server; reaped at once, so its PID is never signalled again."""
        if self._server is not None:
            self.signal(signal.SIGKILL)
            self._server.proc.wait(timeout=30)
            self._server = None

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
