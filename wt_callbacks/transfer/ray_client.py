"""The control-plane client for vLLM ``LLM``/``AsyncLLM`` Ray actors (or our
``RayReceiver``): vLLM's ``RayVLLMWeightSyncClient``, imported from
``wt_callbacks.transfer.clients`` beside the HTTP client."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from wt_callbacks.transfer.auth import api_key_or_env
from wt_callbacks.transfer.base import (
    WeightTransferError,
    WeightTransferInitRequest,
    WeightTransferUpdatePayload,
    WeightTransferUpdateRequest,
)
from wt_callbacks.transfer.server_group import assign_rank_offsets


class RayVLLMWeightSyncClient:
    """Talks to one or more vLLM ``LLM``/``AsyncLLM`` Ray actors.

    Every call passes its arguments by keyword (``request=``,
    ``weight_version=``, ``new_version=``: the parameter names of vLLM's
    ``LLM``/``AsyncLLM``): a handle to a vLLM actor, in a process without
    vLLM (a trainer's), cannot load its methods' signatures, whose
    annotations name vLLM's types, and Ray then accepts keywords only.

    Args:
        handle: an actor handle, a named actor's name, or a list of either.
        timeout: seconds to wait for each fan-out call.
        namespace: Ray namespace for named actors.
        shared_group: ``True`` when the actors are DP ranks of *one* vLLM
            deployment (they compute distinct ranks themselves from their
            ``data_parallel_index``): all get the same init info, as in vLLM.
            ``False`` (default) for independent servers: each gets its own
            ``rank_offset``.
        world_sizes: each actor's inference world size; when omitted it is
            asked from the actors' ``get_world_size()`` method.
        api_key: the token the actors' worker engines check at init (their
            ``VLLM_API_KEY``); defaults to this process's ``VLLM_API_KEY``.
            Ray's own authentication guards the calls.
    """

    def __init__(
        self,
        handle: Any,
        *,
        timeout: float = 300,
        namespace: str | None = None,
        shared_group: bool = False,
        world_sizes: Sequence[int] | None = None,
        api_key: str | None = None,
    ) -> None:
        import ray

        items = handle if isinstance(handle, (list, tuple)) else [handle]
        if not items:
            raise ValueError("handle: give at least one Ray actor handle or actor name")
        self.handles = [ray.get_actor(h, namespace=namespace) if isinstance(h, str) else h for h in items]
        if world_sizes is not None and len(world_sizes) != len(self.handles):
            raise ValueError(
                f"world_sizes has {len(world_sizes)} entries for {len(self.handles)} actors"
            )
        self.timeout = float(timeout)
        self.shared_group = shared_group
        self._world_sizes = list(world_sizes) if world_sizes is not None else None
        self.api_key = api_key_or_env(api_key)

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        import ray

        try:
            return ray.get(refs, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise WeightTransferError(f"Ray actors did not finish {what} within {self.timeout:g} s") from e

    def world_sizes(self) -> list[int]:
        if self._world_sizes is None:
            try:
                refs = [h.get_world_size.remote() for h in self.handles]
            except AttributeError as e:
                raise ValueError(
                    "the actors have no get_world_size() method: pass world_sizes=[...] "
                    "to RayVLLMWeightSyncClient"
                ) from e
            self._world_sizes = [int(s) for s in self._get(refs, "get_world_size")]
        return list(self._world_sizes)

    def get_world_size(self) -> int:
        if self.shared_group:
            return self.world_sizes()[0]
        return sum(self.world_sizes())

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if self.shared_group or len(self.handles) == 1:
            payloads = [dict(init_info)] * len(self.handles)
        else:
            try:
                payloads = assign_rank_offsets(init_info, self.world_sizes())
            except ValueError as e:
                # vLLM's own Ray client sends every actor the same init info
                # (the DP ranks of one deployment); code written for it lands here.
                raise ValueError(
                    f"{e}. If these actors are the data-parallel ranks of one vLLM deployment, pass "
                    "shared_group=True: they then take the same init info and place themselves"
                ) from e
        refs = [
            h.init_weight_transfer_engine.remote(request=WeightTransferInitRequest(init_info=p))
            for h, p in zip(self.handles, payloads)
        ]
        self._get(refs, "init_weight_transfer_engine")

    def shutdown_weight_transfer_engine(self) -> None:
        self._get([h.shutdown_weight_transfer_engine.remote() for h in self.handles], "shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._get([h.start_weight_update.remote() for h in self.handles], "start_weight_update")

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        request = WeightTransferUpdateRequest(update_info=update_info)
        self._get([h.update_weights.remote(request=request) for h in self.handles], "update_weights")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        # vLLM's LLM/AsyncLLM take the version in the same call, so the
        # version switches atomically with the weights.
        kwargs = {} if weight_version is None else {"weight_version": weight_version}
        self._get([h.finish_weight_update.remote(**kwargs) for h in self.handles], "finish_weight_update")

    def update_weight_version(self, new_version: str) -> None:
        self._get(
            [h.update_weight_version.remote(new_version=new_version) for h in self.handles], "update_weight_version"
        )

    def server_hosts(self) -> list[str]:
        """Where each actor runs, as this process reaches it: loopback for an
        actor on this process's Ray node, else its node's address (what a
        trainer engine's group must be reachable from)."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        nodes = self._get([h.__ray_call__.remote(fn=_actor_node) for h in self.handles], "locating the actors")
        return ["127.0.0.1" if node_id == here else ip for node_id, ip in nodes]


def _actor_node(actor: Any) -> tuple[str, str]:
    """Run inside an actor (``__ray_call__``): its Ray node's id and address."""
    import ray

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
