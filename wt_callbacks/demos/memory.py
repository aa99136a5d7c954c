"""What a block of code adds to this process's peak resident memory (Linux).

The kernel's high-water mark (``VmHWM``) is reset through
``/proc/self/clear_refs`` before the block, so the peak is exact, not
sampled. glibc keeps freed blocks below its (dynamic) mmap threshold, so the
first time a size is allocated it counts fully and later rounds may reuse
it; run with ``MALLOC_MMAP_THRESHOLD_`` fixed (e.g. 65536) for peaks that
follow what is live.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from wt_callbacks.host_memory import status_bytes


@dataclass
class PeakRss:
    """Filled in when the ``peak_extra_rss()`` block ends."""

    baseline: int = 0
    peak: int = 0

    @property
    def extra(self) -> int:
        """Bytes the block added at its peak."""
        return max(self.peak - self.baseline, 0)


@contextmanager
def peak_extra_rss() -> Iterator[PeakRss]:
    """``with peak_extra_rss() as rss: ...`` then ``rss.extra``."""
    result = PeakRss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    result.baseline = status_bytes("VmRSS")
    try:
        yield result
    finally:
        result.peak = status_bytes("VmHWM")
