"""The examples run as a user runs them (the README's main job: tests/test_readme.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT


def run_example(*args: str) -> str:
    # The repository first on the path: from a worktree, its code, not an installed copy.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_plain_torch_loop(dtype):
    args = ["examples/plain_torch_loop.py", "--steps", "40", "--sync-every", "20"]
    out = run_example(*args, *(["--dtype", dtype] if dtype else []))
    assert "server versions: ['step-20', 'step-40']" in out
    assert "receiver checksums equal the trainer's: True" in out


def test_accelerate_loop_two_processes_with_the_example_config():
    out = run_example(
        # Port 0: a free one, not the default 29500 another test may hold meanwhile.
        "-m", "accelerate.commands.launch", "--config_file", "examples/accelerate_config.yaml", "--main_process_port", "0",
        "examples/accelerate_loop.py", "--steps", "60",
    )  # fmt: skip
    assert "versions served: ['step-0', 'step-30', 'step-60']" in out
    assert "receiver checksums equal the trainer's weights: True" in out


@pytest.mark.parametrize("send", ["blocking", "async"])
def test_online_rl_smoke(tmp_path, send):
    plot = tmp_path / "online_rl.png"
    out = run_example(
        "examples/online_rl.py", "--steps", "6", "--sync-every", "2", "--prompts", "2", "--group", "4",
        "--send", send, "--plot", str(plot),
    )  # fmt: skip
    # A reward line per sync after the cold one; every rollout came from synced weights.
    lines = [line for line in out.splitlines() if line.startswith("sync ")]
    assert [line.split(":")[0].split()[-1] for line in lines] == ["step-2", "step-4", "step-6"], out[-3000:]
    assert all("rollouts from the weights of steps" in line for line in lines)
    assert "reward:" in out and f"with send: {send}" in out and plot.stat().st_size > 0
