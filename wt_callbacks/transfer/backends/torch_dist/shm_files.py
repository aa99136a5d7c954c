"""The ``shm`` ring's file in ``/dev/shm``: its name, creation, mapping and removal.

A ring file exists only while the ranks map it: rank 0 creates it
(``create_ring_file``), every rank maps it (``map_ring_file``), and rank 0
unlinks it as soon as every rank reported (``unlink_ring``); what a process
still holds at exit is unlinked then.
"""

from __future__ import annotations

import atexit
import mmap
import os
import secrets

import torch

SHM_DIR = "/dev/shm"
SHM_NAME_PREFIX = "wt_callbacks-ring-"
"""Ring files are ``SHM_DIR/SHM_NAME_PREFIX<creator pid>-<random token>``; each
exists only while the ranks map it (rank 0 unlinks it as soon as every rank
reported). The pid (in the trainer's pid namespace) tells whose a file is
when several trainers share a host."""


_RINGS_TO_UNLINK: set[str] = set()
"""Ring files created here and not yet unlinked. A rendezvous the trainer gave
up on (a server refused it) leaves its thread waiting for the workers'
reports, and daemon threads die silently at exit: ``atexit`` unlinks what
they still hold."""


@atexit.register
def _unlink_rings_at_exit() -> None:
    for path in list(_RINGS_TO_UNLINK):
        unlink_ring(path)


def unlink_ring(path: str) -> None:
    _RINGS_TO_UNLINK.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def ring_path(creator: int | str, token: str) -> str:
    """The ring file of process ``creator`` with random ``token`` (see
    ``SHM_NAME_PREFIX``); either may be a glob pattern (``"*"``)."""
    return os.path.join(SHM_DIR, f"{SHM_NAME_PREFIX}{creator}-{token}")


def ring_creator(path: str) -> int | None:
    """The pid that created ring file ``path``; ``None`` for a name that is not a ring's."""
    name = os.path.basename(path)
    creator = name.removeprefix(SHM_NAME_PREFIX).split("-", 1)[0]
    return int(creator) if name.startswith(SHM_NAME_PREFIX) and creator.isdecimal() else None


def create_ring_file(nbytes: int) -> str:
    path = ring_path(os.getpid(), secrets.token_hex(16))
    # 0600: only processes of this user may map the ring (a server running as
    # another user reports that it cannot, and the negotiation handles it).
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    _RINGS_TO_UNLINK.add(path)
    try:
        # Reserve the pages now: on a full tmpfs a sparse file turns the
        # first write into it into a SIGBUS instead of an error here.
        os.posix_fallocate(fd, 0, nbytes)
    except BaseException:
        unlink_ring(path)
        raise
    finally:
        os.close(fd)
    return path


def map_ring_file(path: str, nbytes: int) -> torch.Tensor:
    # Mapped from the descriptor opened without O_CREAT: opening by name again
    # (``torch.from_file`` creates a missing file) would let a worker with its
    # own /dev/shm, or one racing rank 0's unlink, map a fresh private ring and
    # leave that file behind.
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise OSError(f"{path} has {size} bytes, the ring needs {nbytes}")
        # The tensor keeps the mmap object (and so the mapping) alive.
        return torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
    finally:
        os.close(fd)
