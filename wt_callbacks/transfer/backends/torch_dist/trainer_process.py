"""The trainer process as a worker on its host sees it: has it exited?

A killed trainer sets no abort flag in the ``shm`` ring, and its heartbeat is
missed only after ``HEARTBEAT_TIMEOUT_S``; a worker that can read the
trainer's entry in ``/proc`` can tell at once. The ring's offer carries the
trainer's identity (``TrainerProcess.identity``); a worker checks on it while
it waits (``shm_ring.ShmRing``).
"""

from __future__ import annotations

import os

EXIT_CHECK_INTERVAL_S = 0.05
"""How often a waiting worker checks that the trainer process still runs."""


class TrainerProcess:
    """The trainer process (rank 0), as a worker on its host can tell that it exited.

    A killed trainer sets no abort flag, and its heartbeat is only missed
    after ``HEARTBEAT_TIMEOUT_S``; but a worker that sees the trainer's
    process table can tell at once: ``/proc/<pid>/stat`` gone, a zombie, or
    another process with that pid (its start time differs). That holds only
    in the trainer's pid namespace (``/proc/self/ns/pid`` identifies it): a
    worker in another one (a container sharing ``/dev/shm`` but not pids)
    cannot check and relies on the heartbeat.
    """

    def __init__(self, identity: dict[str, int]) -> None:
        self.pid, self.started = identity["pid"], identity["started"]

    @staticmethod
    def identity() -> dict[str, int] | None:
        """This process's pid, start time and pid namespace, for the ring offer
        (``None`` without a ``/proc`` of this pid namespace)."""
        try:
            return {"pid": os.getpid(), "started": _start_time(os.getpid()), "pid_ns": _pid_namespace()}
        except (OSError, ValueError, IndexError):
            return None

    @classmethod
    def checkable(cls, identity: dict[str, int] | None) -> TrainerProcess | None:
        """The offered trainer, if this process can check on it."""
        try:
            if identity and identity["pid_ns"] == _pid_namespace() and _start_time(identity["pid"]) == identity["started"]:
                return cls(identity)
        except (OSError, ValueError, IndexError, KeyError, TypeError):
            pass
        return None

    def exited(self) -> bool:
        """Only a missing entry counts as an exit: any other failure to read it
        (out of file descriptors, say) leaves the verdict to the heartbeat."""
        try:
            return _start_time(self.pid) != self.started
        except (FileNotFoundError, ProcessLookupError):
            return True
        except (OSError, ValueError, IndexError):
            return False


def _pid_namespace() -> int:
    """The inode of this process's pid namespace, once ``/proc`` is known to
    be this namespace's: a ``/proc`` mounted from another would name other
    processes by these pids."""
    with open("/proc/self/stat", "rb") as stat:
        if int(stat.read().split(maxsplit=1)[0]) != os.getpid():
            raise ValueError("/proc belongs to another pid namespace")
    return os.stat("/proc/self/ns/pid").st_ino


def _start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot); ``None``
    once the process is dead but not yet reaped (a zombie whose threads all
    ended: a leader thread that returned while others run shows ``Z`` too).
    Raises ``FileNotFoundError`` if there is no such process."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rpartition(b")")[2].split()  # the name in parentheses may hold spaces
    if fields[0] in (b"Z", b"X") and len(os.listdir(f"/proc/{pid}/task")) <= 1:
        return None
    return int(fields[19])
