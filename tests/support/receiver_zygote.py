"""``python -m tests.support.receiver_zygote``: forks reference receivers on request.

The fault tests kill and restart receivers many times; a fresh interpreter
pays the torch import each time (seconds on a loaded 2-core machine). This
process imports everything once and forks one receiver per request, each a
real process running ``python -m wt_callbacks.receiver``'s ``main``. It is
single-threaded when it forks.

A child is reaped only when the test asks (``reap``), never on its own: until
then its PID stays reserved (a zombie at worst), so a signal the test sends
by PID can only reach that receiver, never a process that reused the number.

Protocol: one JSON line per request on stdin, one line of answer on stdout:
``{"fork": [...argv], "log": PATH}`` -> the child's PID (its output goes to
``log``); ``{"poll": PID}`` -> ``true`` while it runs (an exited child is
reaped then: the test never signals it again); ``{"reap": PID}`` -> SIGKILL
(a stopped child too), wait for it, ``true``.
"""

import json
import os
import signal
import sys
import traceback

import fastapi  # noqa: F401 - imported once here rather than in every child
import uvicorn  # noqa: F401

import wt_callbacks.demos.models  # noqa: F401
import wt_callbacks.receiver.http  # noqa: F401
from wt_callbacks.receiver import cli


def _fork(argv: list[str], log_path: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    code = 1
    try:
        cli.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except BaseException:  # noqa: BLE001 - reported in the child's log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    children: set[int] = set()  # forked, not reaped
    for line in sys.stdin:
        request = json.loads(line)
        if "fork" in request:
            pid = _fork(request["fork"], request["log"])
            children.add(pid)
            answer: object = pid
        elif "poll" in request:
            pid = request["poll"]
            if pid in children and os.waitpid(pid, os.WNOHANG)[0] == pid:
                children.discard(pid)
            answer = pid in children
        else:
            pid = request["reap"]
            if pid in children:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                children.discard(pid)
            answer = True
        print(json.dumps(answer), flush=True)
    for pid in children:  # stdin closed: the test is done (or died)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
