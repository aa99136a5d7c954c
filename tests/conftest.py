import os
import sys
from pathlib import Path

import pytest

# Tests import `tests.support`; subprocesses get the same root via PYTHONPATH.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.support.procs import ReceiverProcess, start_receiver  # noqa: E402


@pytest.fixture
def receiver_proc():
    """Factory fixture: start receiver subprocesses, all stopped at teardown."""
    started: list[ReceiverProcess] = []

    def start(factory: str = "tests.support.models:tiny_mlp", **kwargs) -> ReceiverProcess:
        proc = start_receiver(factory, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
