"""Several servers in one transfer group: the ranks each takes, the size of the group.

The trainer is rank 0. Each independent server gets its own ``rank_offset``
(1 + the workers of the servers before it), so one broadcast from the trainer
reaches all of them; without that, independent servers would all claim ranks
``1..n`` and collide. A group the servers' workers do not fill exactly fails
before any server is called: otherwise the workers refuse one by one, or the
rendezvous waits for ranks that never come.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def servers_and_workers(names: Sequence[str], world_sizes: Sequence[int]) -> str:
    """``"http://a has 4 workers, http://b has 1 worker"``: for errors about a group's size."""
    return ", ".join(f"{n} has {w} worker{'' if w == 1 else 's'}" for n, w in zip(names, world_sizes))


def assign_rank_offsets(
    init_info: Mapping[str, Any], world_sizes: Sequence[int], names: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """One init dict per server, each with its own ``rank_offset``.

    Server i gets ``init_info["rank_offset"] + sum(world_sizes[:i])``; the
    group's ``world_size`` must cover the trainer and every server. Init dicts
    without ``rank_offset`` (backends without a group) are sent unchanged.
    ``names`` (the servers' URLs) go into the error of a mismatch.
    """
    if "rank_offset" not in init_info:
        return [dict(init_info) for _ in world_sizes]
    first = int(init_info["rank_offset"])
    needed = first + sum(world_sizes)
    servers = servers_and_workers(names or [f"server {i}" for i in range(len(world_sizes))], world_sizes)
    if first < 1:
        raise ValueError(
            f"init_info rank_offset={first} must be at least 1: rank 0 is the trainer, and the servers "
            f"({servers}) take the ranks from rank_offset on"
        )
    if "world_size" in init_info and int(init_info["world_size"]) != needed:
        raise ValueError(
            f"init_info world_size={init_info['world_size']} does not match the servers ({servers}): "
            f"rank_offset {first} + server world sizes {list(world_sizes)} = {needed}; "
            f"set world_size to {needed} (or leave it out to have it computed)"
        )
    payloads, offset = [], first
    for size in world_sizes:
        payloads.append({**init_info, "rank_offset": offset})
        offset += size
    return payloads


def group_world_size(client: Any, world_size: int | None = None) -> int:
    """1 (the trainer) + every server's workers, asked from ``client``: what a
    trainer's ``init_info`` may leave out as ``world_size``.

    A ``world_size`` given is checked against it where the client can tell:
    a group the servers' workers do not fill exactly fails here, naming
    each server and its workers, before any server is called (its workers
    would refuse one by one, or the rendezvous wait for ranks that never come).
    """
    get_world_size = getattr(client, "get_world_size", None)
    if not callable(get_world_size):
        if world_size is not None:
            return world_size
        raise ValueError(
            "init_info: world_size is missing and the client has no get_world_size() to ask "
            "the servers; set world_size = 1 + the number of inference workers"
        )
    needed = 1 + int(get_world_size())
    if world_size is not None and world_size != needed:
        urls, sizes = getattr(client, "base_urls", None), getattr(client, "world_sizes", None)
        servers = servers_and_workers(urls, sizes()) if urls and callable(sizes) else f"{needed - 1} workers in all"
        raise ValueError(
            f"init_info world_size={world_size} does not match the servers' workers ({servers}): the group "
            f"is the trainer and every worker, so world_size must be {needed}; set it so, or leave it out to "
            "have it computed"
        )
    return needed
