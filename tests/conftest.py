import os
import time

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.support.transfer import TIMEOUT_S, ring_files  # noqa: E402
from tests.support.vllm import SharedVLLMServer, vllm_python_or_skip  # noqa: E402
from wt_callbacks.demos.receiver_process import ReceiverProcess, start_receiver  # noqa: E402
from wt_callbacks.demos.vllm_server import build_toy_model_dir  # noqa: E402


SHARED_SERVER_GROUP = "vllm-shared-server"
"""The xdist group of every test on the session's shared vLLM server: one
worker runs them in file order, so the server starts once (not once per
worker) and the tests that kill or restart it never race another one using it."""


def _uses_vllm(item: pytest.Item) -> bool:
    return "vllm_python" in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (``scripts/test.sh``) a module runs
    whole on one worker (its module-scoped servers start once), and the tests on
    the shared vLLM server together on one. The tests that start vLLM servers
    come first: they are the longest groups (a start costs 30-60 s), and the
    other workers share out everything else meanwhile (with
    ``--no-loadscope-reorder`` xdist hands out groups in this order)."""
    if config.getoption("dist", "no") == "no":
        return
    for item in items:
        shared = "vllm_server" in getattr(item, "fixturenames", ())
        item.add_marker(pytest.mark.xdist_group(SHARED_SERVER_GROUP if shared else item.path.name))
    items.sort(key=lambda item: not _uses_vllm(item))  # stable: file order within each part


@pytest.fixture
def receiver_proc():
    """Factory fixture: start receiver subprocesses, all stopped at teardown."""
    started: list[ReceiverProcess] = []

    def start(factory: str = "wt_callbacks.demos.models:tiny_mlp", **kwargs) -> ReceiverProcess:
        proc = start_receiver(factory, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def no_ring_left_behind():
    """Fails the test if it leaves a ring file of ours behind."""
    before = ring_files()
    yield
    # A rendezvous the trainer gave up on unlinks on its own thread, and a test
    # running in parallel may hold a ring for up to its timeout: bounded wait.
    deadline = time.monotonic() + TIMEOUT_S
    while ring_files() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ring_files() - before


@pytest.fixture(scope="session")
def vllm_python():
    """The vLLM venv's python (``WT_VLLM_PYTHON``); the vLLM tests skip without it, or fail under CI."""
    return vllm_python_or_skip()


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """The toy Llama checkpoint every shared-server test starts from."""
    return build_toy_model_dir(tmp_path_factory.mktemp("vllm-model") / "toy")


@pytest.fixture(scope="session")
def vllm_server(vllm_python, vllm_model_dir, tmp_path_factory):
    """The session's one fp32 vLLM server with auth on (``SharedVLLMServer``),
    shared by the e2e and fault tests so that they pay for one start, not one each."""
    shared = SharedVLLMServer(vllm_python, vllm_model_dir, tmp_path_factory.mktemp("vllm-shared-logs"))
    yield shared
    shared.stop()
