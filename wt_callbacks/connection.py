"""The control-plane client a ``WeightSync`` talks to the servers through, built from its config."""

from __future__ import annotations

import logging
from typing import Any

from wt_callbacks.config import SyncConfig
from wt_callbacks.transfer.base import VLLMWeightSyncClient, WeightTransferError
from wt_callbacks.transfer.clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient

logger = logging.getLogger(__name__)


class RankZeroOnly:
    """The client of trainer ranks > 0. Engines hold a client on every rank but
    only rank 0 calls it, so other ranks need no session (nor a Ray connection)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise WeightTransferError("only trainer rank 0 talks to the servers")

    init_weight_transfer_engine = start_weight_update = update_weights = finish_weight_update = _refuse


def build_client(config: SyncConfig) -> VLLMWeightSyncClient:
    """Trainer rank 0's client of ``servers`` (HTTP) or ``ray_actors``; warns
    once when it cannot pause generation although ``pause`` asks for it."""
    if config.servers:
        try:
            client: Any = HTTPVLLMWeightSyncClient(config.servers, timeout=config.timeout_s, api_key=config.api_key)
        except ValueError as e:
            raise ValueError(f"servers: {e}") from e
    else:
        client = RayVLLMWeightSyncClient(
            config.ray_actors, timeout=config.timeout_s, namespace=config.ray_namespace, api_key=config.api_key
        )
    if config.pause_mode is not None and not callable(getattr(client, "pause", None)):
        logger.warning(
            "pause=%r: %s cannot pause generation; rounds run without pausing (set pause: none to silence this)",
            config.pause, type(client).__name__,
        )  # fmt: skip
    return client
