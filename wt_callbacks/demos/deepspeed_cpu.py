"""DeepSpeed on a CPU-only host, for the tests and the benchmarks.

Whenever DeepSpeed sets up its communication backend on a CPU it JIT-builds
its shared-memory all-reduce op: about 2 minutes on 2 cores the first time,
guarded by a lock file in ``TORCH_EXTENSIONS_DIR`` whose stale copy (a build
that was killed) makes every later run wait forever, and a 66 MiB
``/dev/shm`` file per rank that outlives a run which did not destroy its
process group. Only ``inference_all_reduce`` uses the op; training and
weight sync never do. No setting turns the build off, so
``skip_shm_comm_op()`` marks the op incompatible in DeepSpeed's op table,
and DeepSpeed falls back to plain ``torch.distributed``: nothing is built,
locked or mapped.
"""

from __future__ import annotations

import os

CPU_ENV = {"DS_ACCELERATOR": "cpu"}
"""Environment a DeepSpeed process on a CPU-only host needs (skips the accelerator probe)."""


def skip_shm_comm_op() -> None:
    """Keep DeepSpeed from building its shared-memory op; call before it
    initializes its backend (``deepspeed.initialize``, ``init_distributed``,
    ``Accelerator()`` under ``--use_deepspeed``)."""
    os.environ.update(CPU_ENV)
    import deepspeed.ops

    # DeepSpeed consults this table (probed once per process) before building.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def shm_files() -> set[str]:
    """DeepSpeed's files in ``/dev/shm`` (the op maps one per rank); none
    appear once ``skip_shm_comm_op()`` ran."""
    import glob

    return set(glob.glob("/dev/shm/deepspeed*"))
