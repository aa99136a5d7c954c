"""Two hosts on one machine: a network namespace of the test's own, joined to this one by a veth pair.

The other "host" has its own loopback and ports and reaches this one only
over the link, as a machine on the same network would: a server there is not
on this host's 127.0.0.1, and this host's loopback is not its. Names carry a
random suffix and the subnet is one no interface uses yet (chosen under a
lock file shared by every run on the machine), so parallel runs never collide; the namespace, its link and whatever still runs in it are
removed at teardown. Where the machine cannot make namespaces (not root, no
``ip`` command, not permitted) the test is skipped, saying which.
"""

from __future__ import annotations

import fcntl
import os
import random
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

LINK = "10.77.{}.{}"
"""The link's /24; its third byte is chosen per run among those no address or route of this host uses."""
UNREACHABLE = "10.78.{}.1"
"""An address of this host the other one has no route to (a /32 on this side of the link)."""
SECOND_NETWORK = "10.79.{}.{}"
"""A second network of this host (a /24 on this side of the link, the other host not in it)."""


@dataclass(frozen=True)
class TwoHosts:
    namespace: str
    here: str
    """This host's address on the link (the trainer's)."""
    there: str
    """The other host's address (the servers')."""
    unreachable: str
    """An address of this host the other cannot reach."""
    second_network: str
    """A host on a second network of this host, reached from another of its
    addresses than ``there`` (nothing answers there)."""

    @property
    def run_there(self) -> tuple[str, ...]:
        """A command prefix that runs a program on the other host (it execs: same PID)."""
        return ("ip", "netns", "exec", self.namespace)


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def _free_subnet_byte() -> int:
    used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=30).stdout
    used += subprocess.run(["ip", "route"], capture_output=True, text=True, timeout=30).stdout
    free = [b for b in range(1, 255) if all(f"10.{n}.{b}." not in used for n in (77, 78, 79))]
    if not free:
        pytest.fail("no free 10.77.x.0/24 subnet for the test's link")
    return random.choice(free)


def _stop_processes_in(namespace: str) -> None:
    """What the test left running on the other host (its own processes: nothing else runs there)."""
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30)
    pids = [int(p) for p in out.stdout.split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
            time.sleep(0.1)


@contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    if os.geteuid() != 0:
        pytest.skip("two hosts need network namespaces, which need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("two hosts need network namespaces: no `ip` command (iproute2) on this machine")
    suffix = secrets.token_hex(3)
    namespace, near, far = f"wt-{suffix}-{os.getpid()}", f"wt{suffix}a", f"wt{suffix}b"
    try:
        _ip("netns", "add", namespace)
    except OSError as e:
        if "permitted" in str(e) or "denied" in str(e):
            pytest.skip(f"this machine cannot make network namespaces: {e}")
        raise
    try:
        _ip("link", "add", near, "type", "veth", "peer", "name", far)
        _ip("link", "set", far, "netns", namespace)
        # One run at a time picks a subnet and takes it: Linux lets two
        # interfaces hold the same address without complaint.
        with open(os.path.join(tempfile.gettempdir(), "wt-netns-subnets.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            byte = _free_subnet_byte()
            hosts = TwoHosts(
                namespace, LINK.format(byte, 1), LINK.format(byte, 2), UNREACHABLE.format(byte),
                SECOND_NETWORK.format(byte, 2),
            )  # fmt: skip
            _ip("addr", "add", f"{hosts.here}/24", "dev", near)
            _ip("addr", "add", f"{hosts.unreachable}/32", "dev", near)
            _ip("addr", "add", f"{SECOND_NETWORK.format(byte, 1)}/24", "dev", near)
        _ip("link", "set", near, "up")
        _ip("netns", "exec", namespace, "ip", "addr", "add", f"{hosts.there}/24", "dev", far)
        _ip("netns", "exec", namespace, "ip", "link", "set", far, "up")
        _ip("netns", "exec", namespace, "ip", "link", "set", "lo", "up")
        yield hosts
    finally:
        _stop_processes_in(namespace)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        # Gone with its peer's namespace; removed here if it was made before that moved.
        subprocess.run(["ip", "link", "del", near], capture_output=True, timeout=30)
