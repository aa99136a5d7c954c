"""This process's memory as Linux reports it (``/proc/self/status``)."""

from __future__ import annotations


def status_bytes(key: str) -> int:
    """The ``key`` line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``,
    ``RssAnon``, ...) in bytes; ``KeyError`` where the kernel has no such line."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)
