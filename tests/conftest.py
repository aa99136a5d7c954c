import os
import time
import warnings

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.support.faults import FAULT_TABLES, FAULT_TABLES_KEY  # noqa: E402
from tests.support.transfer import TIMEOUT_S, ring_files, rings_left_behind  # noqa: E402
from tests.support.vllm import SharedVLLMServer, vllm_python_or_skip  # noqa: E402
from wt_callbacks.demos.receiver_process import ReceiverProcess, start_receiver  # noqa: E402
from wt_callbacks.demos.vllm_server import build_toy_model_dir  # noqa: E402


def _uses_vllm(item: pytest.Item) -> bool:
    return "vllm_python" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker (``scripts/test.sh``: ``-n 3 --dist loadfile
    --no-loadscope-reorder``) the modules that start vLLM servers come first:
    they are the longest (a start costs 30-60 s), and xdist hands out modules
    in this order, so the other workers share out everything else meanwhile.
    A plain ``pytest`` run keeps file order."""
    if not hasattr(config, "workerinput"):
        return
    vllm_files = {item.path for item in items if _uses_vllm(item)}
    items.sort(key=lambda item: item.path not in vllm_files)  # stable: file order within each part


@pytest.fixture(autouse=True, scope="module")
def no_default_process_group_left(request):
    """A test file that leaves torch's default process group up (a strategy
    or hook started in this process that does not end it) makes the next
    file this pytest worker runs fail to start its own ("trying to
    initialize the default process group twice"), depending on how xdist
    shared out the files: it is ended after each file, with a warning that
    names the file."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        warnings.warn(f"{request.module.__name__} left torch's default process group up; ended it", stacklevel=1)
        dist.destroy_process_group()


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
    # A rendezvous the trainer gave up on unlinks on its own thread: bounded wait.
    deadline = time.monotonic() + TIMEOUT_S
    left = rings_left_behind(before)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = rings_left_behind(before)
    assert not left


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """An xdist worker finished: keep the fault tables it could not print."""
    FAULT_TABLES.extend(node.workeroutput.get(FAULT_TABLES_KEY, []))


def pytest_terminal_summary(terminalreporter) -> None:
    for lines in FAULT_TABLES:
        terminalreporter.write_line("")
        for line in lines:
            terminalreporter.write_line(line)


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
    shared by the e2e and fault tests so that they pay for one start, not one
    each (one per xdist worker that runs them: a worker is its own session)."""
    shared = SharedVLLMServer(vllm_python, vllm_model_dir, tmp_path_factory.mktemp("vllm-shared-logs"))
    yield shared
    shared.stop()
