"""The README's snippets run as written: each one is extracted from README.md and run.

Every ```python and ```bash fence carries a mark on the line before it (an HTML
comment, invisible on GitHub), so a new snippet is classified when it is written:

    <!-- snippet: run -->                     run as written (python: a file run by the
                                              project's python, in a scratch directory
                                              that links the repository's examples/;
                                              bash: ``bash -euo pipefail`` in the repository)
    <!-- snippet: run needs=receiver -->      a reference receiver serving the toy task's
                                              model, at the URL the snippet names
                                              (http://127.0.0.1:8000): one for all the
                                              snippets, which must push weights into it;
                                              ``pushes=no`` (only reads what it serves):
                                              a fresh one of its own
    <!-- snippet: run needs=vllm -->          needs the vLLM venv (WT_VLLM_PYTHON)
    <!-- snippet: serve -->                   a server command: it must print its
                                              "serving on" line; then it is stopped
    <!-- snippet: illustrative why="..." -->  not run; the reason is required

What the test changes is kept here, not in the README: test sizes (``TEST_SIZE``),
lines it does not run (``NOT_IN_TEST``), the interpreters (the ones running the
tests), the port (a free one, never 8000) and the model directory (a temporary one);
and what it checks beyond the exit status (``EXPECTED_OUTPUT``).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from tests.support import REPO_ROOT
from wt_callbacks.demos.multiprocess import free_port
from wt_callbacks.demos.receiver_process import URL_MARKER, start_receiver
from wt_callbacks.demos.vllm_server import REQUIRE_VLLM_ENV, find_vllm_python

README = REPO_ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!--\s*snippet:\s*(?P<kind>run|serve|illustrative)(?P<attrs>.*?)-->\s*$")
ATTR = re.compile(r'(\w+)=(?:"([^"]*)"|(\S+))')
RUN_TIMEOUT_S = 600

TEST_SIZE = {
    "examples/lightning_quickstart.py": ["--steps", "20", "--sync-every", "10"],
    "examples/lightning_cli.py": ["--trainer.max_steps", "10"],
    "examples/online_rl.py": ["--steps", "4", "--sync-every", "2", "--prompts", "2", "--group", "2"],
}
"""Arguments appended to a script's command line: small, fast runs."""
EXPECTED_OUTPUT = {
    "bash scripts/setup.sh && .venv/bin/python examples/lightning_quickstart.py": [
        *(f"weight sync {v}:" for v in ("step-0", "step-10", "step-20")),
        *(f"served {v:>9} solves" for v in ("step-0", "step-10", "step-20")),
        "receiver checksums equal the trainer's weights: True",
    ],
}
"""Lines the output must contain, per README command line (the main job)."""
NOT_IN_TEST = {
    "bash scripts/setup.sh": "the test runs in the venv it makes",
    "bash scripts/vllm_env.sh": "the vLLM venv is given by WT_VLLM_PYTHON",
}
"""Commands of bash snippets the test leaves out, and why."""
SERVER = "127.0.0.1:8000"
"""What snippets call the server; the test puts its own port there."""
MODEL_DIR = "./my-model"


@dataclass
class Snippet:
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    kind: str | None  # None: unmarked
    attrs: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        first = next((l for l in self.code.splitlines() if l.strip()), "")
        return f"README.md:{self.line} {self.lang} [{self.kind or 'UNMARKED'}] {first[:60]}"


def extract(text: str) -> list[Snippet]:
    """Every ```python / ```bash fence, with the mark on the line before it."""
    lines = text.splitlines()
    snippets, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        if opening.group(1) in ("python", "bash"):
            mark = MARK.match(lines[i - 1].strip()) if i > 0 else None
            attrs = {a[0]: a[1] or a[2] for a in ATTR.findall(mark.group("attrs"))} if mark else {}
            code = "\n".join(lines[i + 1 : end]) + "\n"
            snippets.append(Snippet(opening.group(1), code, i + 1, mark and mark.group("kind"), attrs))
        i = end + 1
    return snippets


SNIPPETS = extract(README.read_text())
RUNNABLE = [s for s in SNIPPETS if s.kind in ("run", "serve")]


def test_every_snippet_is_marked():
    problems = [f"{s.label}: mark it <!-- snippet: run|serve|illustrative why=... -->" for s in SNIPPETS if s.kind is None]
    problems += [f"{s.label}: say why it is illustrative" for s in SNIPPETS if s.kind == "illustrative" and not s.attrs.get("why")]
    assert not problems, "\n".join(problems)
    assert RUNNABLE, "the README has no runnable snippet"


def _test_sized(line: str) -> str | None:
    """One command line as the test runs it (``None``: not run)."""
    kept = []
    for part in (p.strip() for p in re.sub(r"\s+#.*$", "", line).split("&&")):
        if part in NOT_IN_TEST:
            continue
        background = part.endswith("&")
        part = part.removesuffix("&").rstrip()
        script = next((w for w in shlex.split(part) if w in TEST_SIZE), None)
        if script is not None:
            part += " " + shlex.join(TEST_SIZE[script])
        kept.append(part + (" &" if background else ""))
    return " && ".join(kept) if kept else None


def _rewrite(code: str, *, server: str, model_dir: Path, vllm_python: Path | None) -> str:
    code = code.replace(SERVER, server).replace("--port 8000", f"--port {server.rsplit(':', 1)[1]}")
    code = code.replace(MODEL_DIR, str(model_dir)).replace(".venv/bin/python", sys.executable)
    if vllm_python is not None:
        code = code.replace(".venv-vllm/bin/python", str(vllm_python))
    return code


def _command(snippet: Snippet, code: str, tmp_path: Path) -> list[str]:
    if snippet.lang == "python":
        path = tmp_path / "snippet.py"
        path.write_text(code)
        return [sys.executable, str(path)]
    # Backslash continuations joined, so each rewritten line is a whole command.
    lines = [_test_sized(l) for l in code.replace("\\\n", " ").splitlines() if l.strip() and not l.lstrip().startswith("#")]
    return ["bash", "-euo", "pipefail", "-c", "\n".join(l for l in lines if l)]


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the session the snippet ran in (its servers included), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def shared_receiver():
    """One receiver subprocess for every snippet that pushes into one."""
    receiver = start_receiver("wt_callbacks.demos.toy_task:served_model")
    yield receiver
    receiver.stop()


def _updates(url: str) -> int:
    return requests.get(f"{url}/weight_info", timeout=30).json()["updates_completed"]


@pytest.mark.parametrize("snippet", RUNNABLE, ids=[f"README.md:{s.line}" for s in RUNNABLE])
def test_snippet_runs_as_written(snippet: Snippet, tmp_path, request):
    vllm_python = None
    if snippet.attrs.get("needs") == "vllm":
        vllm_python, reason = find_vllm_python()
        if vllm_python is None:
            if os.environ.get(REQUIRE_VLLM_ENV) == "1":
                pytest.fail(f"{reason} ({REQUIRE_VLLM_ENV}=1)")
            pytest.skip(reason)
    receiver, own_receiver, updates_before = None, False, 0
    if snippet.attrs.get("needs") == "receiver":
        own_receiver = snippet.attrs.get("pushes") == "no"
        if own_receiver:  # it must see the weights the receiver started with
            receiver = start_receiver("wt_callbacks.demos.toy_task:served_model")
        else:
            receiver = request.getfixturevalue("shared_receiver")
            updates_before = _updates(receiver.url)
        server = receiver.url.removeprefix("http://")
    else:
        server = f"127.0.0.1:{free_port()}"
    code = _rewrite(snippet.code, server=server, model_dir=tmp_path / "my-model", vllm_python=vllm_python)
    # The repository first on the path: from a worktree, its code and not an installed copy.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "MPLBACKEND": "Agg"}
    cwd = REPO_ROOT
    if snippet.lang == "python":  # what it writes stays out of the repository
        cwd = tmp_path / "cwd"
        cwd.mkdir()
        (cwd / "examples").symlink_to(REPO_ROOT / "examples")
    proc = subprocess.Popen(
        _command(snippet, code, tmp_path), cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    output: list[str] = []
    try:
        if snippet.kind == "serve":
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                line = proc.stdout.readline()
                output.append(line)
                if URL_MARKER in line:
                    return
            pytest.fail(f"{snippet.label} did not print {URL_MARKER!r}:\n{''.join(output)[-5000:]}")
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        assert proc.returncode == 0, f"{snippet.label} failed:\n{out[-6000:]}"
        commands = {line.strip() for line in snippet.code.splitlines()}
        expected = [line for command, lines in EXPECTED_OUTPUT.items() if command in commands for line in lines]
        missing = [line for line in expected if line not in out]
        assert not missing, f"{snippet.label}: output lacks {missing}:\n{out[-6000:]}"
        if receiver is not None and not own_receiver:
            assert _updates(receiver.url) > updates_before, f"{snippet.label} synced nothing into the receiver:\n{out[-3000:]}"
    finally:
        _stop_group(proc)
        if own_receiver:
            receiver.stop()
