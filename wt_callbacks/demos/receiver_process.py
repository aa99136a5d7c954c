"""The reference receiver in a child process: started with a bounded wait, stopped by PID.

``start_receiver`` runs ``python -m wt_callbacks.receiver`` and waits for the
line that names its URL; the receiver's output (stdout and stderr) is kept in
``ReceiverProcess.output``. ``receiver_checksums`` fetches what it holds,
also from processes that have only its URL (spawned trainer ranks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import requests

URL_MARKER = "serving on "
"""What precedes the URL in the receiver's start-up line (``wt_callbacks.receiver.cli``)."""


def receiver_checksums(url: str, timeout_s: float = 30.0) -> dict[str, str]:
    """``GET /weight_checksums`` of the receiver at ``url``: sha256 per parameter."""
    response = requests.get(f"{url}/weight_checksums", timeout=timeout_s)
    response.raise_for_status()
    return response.json()["checksums"]


@dataclass
class ReceiverProcess:
    """A running receiver started by ``start_receiver``; a context manager that stops it."""

    proc: subprocess.Popen
    url: str
    output: list[str] = field(default_factory=list)

    def kill(self) -> None:
        """SIGKILL: a crash, as far as the trainer can tell."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it is still alive after 15 s."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def log(self) -> str:
        return "".join(self.output)

    def checksums(self, timeout_s: float = 30.0) -> dict[str, str]:
        return receiver_checksums(self.url, timeout_s)

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_receiver(
    factory: str = "wt_callbacks.demos.models:tiny_mlp",
    *,
    port: int = 0,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
    wrapper: tuple[str, ...] = (),
) -> ReceiverProcess:
    """Start ``python -m wt_callbacks.receiver --module-factory factory`` and wait for its URL.

    ``factory=""`` leaves ``--module-factory`` out (give ``--model DIR`` in
    ``extra_args``). ``env`` adds to this process's environment. ``wrapper``:
    a command that execs its arguments in the same process (e.g. ``unshare``),
    so the PID is still the receiver's.
    """
    proc = subprocess.Popen(
        [*wrapper, sys.executable, "-m", "wt_callbacks.receiver", "--port", str(port), *extra_args]
        + (["--module-factory", factory] if factory else []),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    output: list[str] = []
    found: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            if URL_MARKER in line and not found:
                found.append(line.split(URL_MARKER, 1)[1].strip())

    threading.Thread(target=pump, name="receiver-output", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not found and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not found:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        raise RuntimeError(f"receiver did not start within {timeout_s} s:\n{''.join(output)}")
    return ReceiverProcess(proc, found[0], output)
