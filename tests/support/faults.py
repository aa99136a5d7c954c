"""Fault injection for the fault-matrix tests: receivers to kill, freeze and
restart, a proxy that answers 5xx, a client that strikes before a call, and
the table of detection times.

Everything is real: receivers are processes (SIGKILL, SIGSTOP/SIGCONT by
PID), the proxy is an HTTP server answering a real 500, the trainer is the
real ``WeightSync`` over the real client.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests

from tests.support import REPO_ROOT
from wt_callbacks.demos.receiver_process import URL_MARKER, receiver_checksums

START_TIMEOUT_S = 60.0
FULL_MATRIX_ENV = "WT_FAULT_MATRIX"
"""``full``: the fault-matrix modules run every cell; otherwise (CI) each runs
the covering subset its docstring names."""
FULL_MATRIX = os.environ.get(FULL_MATRIX_ENV) == "full"


class ReceiverForks:
    """Starts receivers by forking them from one ``receiver_zygote`` process,
    which also reaps them: a receiver's PID stays its own until ``kill``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._zygote = subprocess.Popen(
            [sys.executable, "-m", "tests.support.receiver_zygote"],
            cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._count = 0
        self.started: list[ForkedReceiver] = []

    def ask(self, request: dict[str, Any]) -> Any:
        """One request to the zygote (see its protocol); its answer."""
        with self._lock:
            assert self._zygote.stdin is not None and self._zygote.stdout is not None
            self._zygote.stdin.write(json.dumps(request) + "\n")
            self._zygote.stdin.flush()
            return json.loads(self._zygote.stdout.readline())

    def fork(self, argv: list[str]) -> tuple[int, Path]:
        with self._lock:
            self._count += 1
            log = self.log_dir / f"receiver-{self._count}.log"
        return int(self.ask({"fork": argv, "log": str(log)})), log

    def start(self, factory: str, *, port: int = 0, extra_args: tuple[str, ...] = ()) -> ForkedReceiver:
        receiver = ForkedReceiver(self, ["--module-factory", factory, *extra_args], port)
        self.started.append(receiver)
        return receiver

    def close(self) -> None:
        for receiver in self.started:
            receiver.kill()
        assert self._zygote.stdin is not None
        self._zygote.stdin.close()  # it kills and reaps what is left, then exits
        try:
            self._zygote.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._zygote.kill()
            self._zygote.wait(timeout=30)


class ForkedReceiver:
    """A reference receiver process that can be killed, frozen and restarted on its port.

    Signals go by PID only while the zygote has not reaped it (``_running``),
    so they can only reach this receiver.
    """

    def __init__(self, forks: ReceiverForks, argv: list[str], port: int) -> None:
        self._forks = forks
        self._argv = argv
        self.pid, self.url = self._launch(port)
        self.port = int(self.url.rsplit(":", 1)[1])

    def _launch(self, port: int) -> tuple[int, str]:
        pid, log = self._forks.fork(["--port", str(port), *self._argv])
        self.pid, self.log_path, self._running = pid, log, True
        deadline = time.monotonic() + START_TIMEOUT_S
        text = ""
        while time.monotonic() < deadline:
            text = log.read_text() if log.exists() else ""
            if URL_MARKER in text:
                return pid, text.split(URL_MARKER, 1)[1].split()[0]
            if not self._forks.ask({"poll": pid}):
                self._running = False
                break
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"forked receiver did not start within {START_TIMEOUT_S:g} s:\n{text}")

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def checksums(self) -> dict[str, str]:
        return receiver_checksums(self.url)

    def kill(self) -> None:
        """SIGKILL (a frozen process too); returns once the process is gone."""
        if self._running:
            self._forks.ask({"reap": self.pid})
            self._running = False

    def freeze(self) -> None:
        """SIGSTOP: its sockets stay open and nothing answers (a hung server)."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        if self._running:
            os.kill(self.pid, sig)

    def restart(self) -> None:
        """A fresh process on the same port (same URL), as a restarted server."""
        self.kill()
        self._launch(self.port)


class FaultProxy:
    """An HTTP proxy in front of one server that answers 500 to chosen calls.

    ``fail_next(route)`` makes the next request to ``/route`` get a 500 in
    vLLM's error shape without reaching the server; every other request is
    forwarded as it came (bearer token included).
    """

    def __init__(self, target_url: str) -> None:
        self.target_url = target_url
        self._fail: set[str] = set()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                route = self.path.split("?", 1)[0].lstrip("/")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._lock:
                    failing = route in proxy._fail
                    proxy._fail.discard(route)
                if failing:
                    status, payload = 500, json.dumps({"error": {
                        "message": f"injected fault: HTTP 500 for /{route}", "type": "InternalServerError",
                        "param": None, "code": 500}}).encode()  # fmt: skip
                else:
                    headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
                    answer = requests.request(
                        self.command, proxy.target_url + self.path, data=body, headers=headers, timeout=600
                    )
                    status, payload = answer.status_code, answer.content
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True).start()

    def fail_next(self, route: str) -> None:
        with self._lock:
            self._fail.add(route)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class FaultyClient:
    """Wraps a control-plane client; ``strike_before(method, fault)`` runs
    ``fault`` once, just before the next call of ``method`` goes out, and
    notes when (``struck_at``, ``time.monotonic()``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._armed: dict[str, Callable[[], None]] = {}
        self.struck_at: float | None = None

    def strike_before(self, method: str, fault: Callable[[], None]) -> None:
        self._armed[method] = fault

    def strike_now(self, fault: Callable[[], None]) -> None:
        self.struck_at = time.monotonic()
        fault()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in self._armed:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            fault = self._armed.pop(name, None)
            if fault is not None:
                self.strike_now(fault)
            return attr(*args, **kwargs)

        return call


def fault_round(
    ws: Any,
    client: FaultyClient,
    model: Any,
    *,
    fault: str,
    phase: str,
    strike: Callable[[], None],
    mid_stream: bool,
    route: str,
    after: int,
    on_error: str,
    bound_s: float,
) -> tuple[float, str]:
    """One round of ``ws`` (a ``WeightSync`` over ``client``) with ``fault``:
    set up first unless it strikes at ``connect``; ``strike`` runs between two
    tensors (``mid_stream``: before the source yields tensor ``after``) or just
    before the call ``route``. Under ``on_error="raise"`` the round must
    raise, under ``"warn"`` return ``None`` and drop its engine, within
    ``bound_s`` of the strike. Returns the seconds from the strike to the end
    of the round and ``"raised (<the error>)"`` or ``"warned"``."""
    from tests.support.transfer import InterruptingSource
    from wt_callbacks.transfer import WeightTransferError

    if phase != "connect":
        ws.setup(model)
    if mid_stream:
        ws.engine.source = InterruptingSource(ws.engine.source, lambda: client.strike_now(strike), after=after)
    else:
        client.strike_before(route, strike)
    round_ = (lambda: ws.setup(model)) if phase == "connect" else (lambda: ws.sync(1))
    if on_error == "raise":
        try:
            round_()
        except WeightTransferError as e:
            # The error without the servers' URLs, which differ from run to run.
            outcome = f"raised ({re.sub(r' ?https?://[^/ ]+', ' ', str(e))[:60].strip()})"
        else:
            raise AssertionError(f"{fault} at {phase}: the round did not raise")
    else:
        assert round_() is None and ws.engine is None
        outcome = "warned"
    assert client.struck_at is not None, "the fault never struck"
    detected = time.monotonic() - client.struck_at
    assert detected < bound_s, f"{fault} at {phase}: the round ended {detected:.1f} s after the fault"
    return detected, outcome


FAULT_TABLES_KEY = "wt_fault_tables"
FAULT_TABLES: list[list[str]] = []
"""Tables the xdist workers sent (``workeroutput[FAULT_TABLES_KEY]``), printed at the end."""


@dataclass
class FaultTable:
    """Detection time and outcome per cell, printed at the end of the module."""

    rows: list[tuple[str, str, float, str]] = field(default_factory=list)

    def add(self, cell: str, mode: str, seconds: float, outcome: str) -> None:
        self.rows.append((cell, mode, seconds, outcome))

    def print(self, config: Any, title: str) -> None:
        """Onto the terminal, past pytest's output capture; from an xdist
        worker (whose output is dropped) to the controller, which prints it
        in its summary (``tests/conftest.py``)."""
        lines = [title, f"{'cell':<44} {'on_error':<8} {'detected':>9}  outcome"]
        lines += [f"{c:<44} {m:<8} {s:>8.2f}s  {o}" for c, m, s, o in sorted(self.rows)]
        workeroutput = getattr(config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput.setdefault(FAULT_TABLES_KEY, []).append(lines)
            return
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        with config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
            reporter.write_line("")
            for line in lines:
                reporter.write_line(line)
