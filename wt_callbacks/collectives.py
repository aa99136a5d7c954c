"""How trainer ranks agree: ``Collectives``, built by each framework adapter.

``WeightSync`` runs every decision that all trainer ranks must take alike
(is a round due, did it succeed) through these two collectives, so it
imports no training framework: the adapter builds them from its own
distributed plumbing (Lightning's strategy, torch.distributed's default
group under Accelerate and the transformers Trainer).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from wt_callbacks.transfer.base import WeightTransferError


def trainer_ranks(framework_rank: int, framework_world_size: int) -> tuple[int, int]:
    """This process's trainer rank and the world size: torch.distributed's
    default group's when it is up, else what the framework reports.

    The group's count is the one ``Collectives.from_torch_distributed`` and the
    sources' gathers run over. A framework's own can differ: under DeepSpeed on
    a CPU-only machine Accelerate (and the transformers Trainer, through it)
    reports one process, index 0, on every rank while DeepSpeed runs a real
    multi-rank group, so every rank would act as the sender.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return framework_rank, framework_world_size


@dataclass(frozen=True)
class Collectives:
    """How trainer ranks agree, built by the framework adapter.

    Both are collectives: every trainer rank calls them, in the same order.
    ``WeightSync`` calls them only when ``world_size > 1``: once per optimizer
    step for a ``train_time_interval`` decision, and twice per round (after
    connect/pause and after the send) to agree on the outcome.

    Attributes:
        broadcast: ``broadcast(obj)`` returns rank 0's ``obj`` on every rank;
            objects are JSON values (``bool``, ``str``, ``None``).
        any_flag: ``any_flag(flag)`` returns ``True`` on every rank if any
            rank passed ``True``.

    Lightning::

        Collectives(broadcast=lambda obj: trainer.strategy.broadcast(obj, src=0),
                    any_flag=lambda flag: trainer.strategy.reduce_boolean_decision(flag, all=False))

    Accelerate (its processes share torch.distributed's default group):
    ``Collectives.from_torch_distributed()``. Their waits are bounded by the
    framework's process-group timeout, not by ``timeout_s``.
    """

    broadcast: Callable[[Any], Any]
    any_flag: Callable[[bool], bool]

    @classmethod
    def from_torch_distributed(cls, group: Any = None) -> Collectives:
        """Collectives over an initialized torch.distributed ``group`` (default:
        the default group), whose rank 0 is trainer rank 0. Objects travel as
        JSON, never pickled."""
        import torch.distributed as dist

        def device() -> torch.device:
            if dist.get_backend(group) == "nccl":
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cpu")

        def src() -> int:
            return 0 if group is None else dist.get_global_rank(group, 0)

        def any_flag(flag: bool) -> bool:
            value = torch.tensor([int(flag)], dtype=torch.int32, device=device())
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
            return bool(value.item())

        def broadcast(obj: Any) -> Any:
            root = src()
            data = json.dumps(obj).encode() if dist.get_rank() == root else b""
            size = torch.tensor([len(data)], dtype=torch.int64, device=device())
            dist.broadcast(size, root, group=group)
            if dist.get_rank() == root:
                buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device())
            else:
                buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device())
            dist.broadcast(buffer, root, group=group)
            return json.loads(buffer.cpu().numpy().tobytes().decode())

        return cls(broadcast=broadcast, any_flag=any_flag)


def describe(exc: BaseException) -> str:
    """An exception as the agreement reports it: ``"TypeName: message"``."""
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Agreement:
    """This rank's side of the weight-sync agreements, over ``collectives``.

    Both methods are collectives when ``world_size > 1``: every trainer rank
    calls them, in the same order. If one fails, a trainer rank is gone and
    no ``on_error`` can keep training, so they raise ``WeightTransferError`` on every
    rank still alive.
    """

    rank: int = 0
    world_size: int = 1
    collectives: Collectives | None = None

    def agree(self, local: str | None) -> str | None:
        """The round's error as every rank sees it: rank 0's if it failed
        (the rank that talks to the servers), else this rank's own, or
        ``None`` when no rank failed (``local``: this rank's error)."""
        if self.world_size == 1:
            return None if local is None else f"trainer rank 0: {local}"
        assert self.collectives is not None
        try:
            flagged = self.collectives.any_flag(local is not None)
        except Exception as e:
            raise self._lost(e, local) from e
        if not flagged:
            return None
        first = self.share(local)
        if first is not None:
            return f"trainer rank 0: {first}"
        return f"trainer rank {self.rank}: {local}" if local else "another trainer rank failed (see its log)"

    def share(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (a JSON value) on every rank; what other ranks pass is ignored."""
        if self.world_size == 1:
            return obj
        assert self.collectives is not None
        try:
            return self.collectives.broadcast(obj if self.rank == 0 else None)
        except Exception as e:
            raise self._lost(e, None) from e

    def _lost(self, error: Exception, local: str | None) -> WeightTransferError:
        return WeightTransferError(
            f"trainer rank {self.rank} could not agree with the other trainer ranks on the weight sync "
            f"round ({describe(error)}): a trainer rank died or hung"
            + (f"; this rank's own error: {local}" if local else "")
        )
