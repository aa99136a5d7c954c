"""Backend ``torch_dist``: a stateless torch.distributed group, trainer -> workers.

Trainer rank 0 and the inference workers form their own process group (the
trainer's default group is left alone) and rank 0 broadcasts every round's
tensors, packed into chunks. Ranks: the trainer is 0, a worker is
``rank_offset + dp_index * world + rank`` (vLLM's layout). Both sides must
agree on everything, so both live in this package, one concern per module:

* ``wire``: the typed configs and the dicts exchanged (vLLM's dense ``nccl`` ones).
* ``group``: the rendezvous store and the ``TransferGroup``; ``rendezvous``:
  the trainer forming it with the servers' workers.
* ``addresses``: the address the trainer advertises (where the servers run).
* ``shm_ring``: the ``shm`` transport, a ring in ``/dev/shm`` on one host;
  ``shm_files`` (its file), ``shm_negotiation`` (whether a group uses it),
  ``trainer_process`` (a worker's check that the trainer still runs).
* ``waits``: server calls on daemon threads and bounded waits on broadcasts.
* ``trainer``: ``TorchDistTrainerWeightTransferEngine``.
* ``worker``: ``TorchDistWeightTransferEngine`` (vLLM's plugin and the
  reference receiver run it); ``staging``: what it stages a round into, and
  the server's settings for that (``WT_STAGING_NICE``, ``WT_STAGING_MEMORY``).
"""

from wt_callbacks.transfer.backends.torch_dist.group import TransferGroup, open_store
from wt_callbacks.transfer.backends.torch_dist.trainer import TorchDistTrainerWeightTransferEngine
from wt_callbacks.transfer.backends.torch_dist.wire import (
    BACKEND,
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    DEFAULT_TIMEOUT_S,
    TRANSPORTS,
    WORKER_TRANSPORTS,
    TorchDistTrainerConfig,
    TorchDistTrainerInitInfo,
    TorchDistWeightTransferInitInfo,
    TorchDistWeightTransferUpdateInfo,
    update_info_for,
)
from wt_callbacks.transfer.backends.torch_dist.worker import TorchDistWeightTransferEngine

__all__ = [
    "BACKEND",
    "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
    "DEFAULT_PACKED_NUM_BUFFERS",
    "DEFAULT_TIMEOUT_S",
    "TRANSPORTS",
    "WORKER_TRANSPORTS",
    "TorchDistTrainerConfig",
    "TorchDistTrainerInitInfo",
    "TorchDistTrainerWeightTransferEngine",
    "TorchDistWeightTransferEngine",
    "TorchDistWeightTransferInitInfo",
    "TorchDistWeightTransferUpdateInfo",
    "TransferGroup",
    "open_store",
    "update_info_for",
]
