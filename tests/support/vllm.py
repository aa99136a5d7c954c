"""Real vLLM servers in the tests: started with bounded waits, failing the test with the log tail."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from wt_callbacks.demos.vllm_server import (
    REQUIRE_VLLM_ENV,
    VLLMServer,
    VLLMStartError,
    find_vllm_python,
    start_vllm_server,
)


def vllm_python_or_skip() -> Path:
    """The vLLM venv's python; skips the test without one, fails it under ``WT_REQUIRE_VLLM=1`` (CI)."""
    python, reason = find_vllm_python()
    if python is None:
        if os.environ.get(REQUIRE_VLLM_ENV) == "1":
            pytest.fail(f"{reason} ({REQUIRE_VLLM_ENV}=1: the real-vLLM tests must run)")
        pytest.skip(reason)
    return python


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


def bf16_rounded(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose weights went through bfloat16 and back (what a bf16 wire delivers)."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return rounded
