"""The servers' token on HTTP: the bearer check our servers make, and what a
caller without the token is answered.

The token is the server's ``VLLM_API_KEY`` (``API_KEY_ENV``, what
vLLM's ``--api-key`` reads); the trainer's client sends it as a bearer token.
The reference receiver and the vLLM middleware ``integrations.vllm_auth``
guard their routes with it; the worker engine checks a proof of it on its own
(``backends.torch_dist.session``).
"""

from __future__ import annotations

import hmac
import os
from typing import Any

API_KEY_ENV = "VLLM_API_KEY"
"""Env var read for the bearer token when ``api_key`` is not given (vLLM's own)."""


def api_key_or_env(api_key: str | None) -> str | None:
    """``api_key``, else ``VLLM_API_KEY`` from the environment; ``None`` when neither is set (or empty)."""
    return (api_key if api_key is not None else os.environ.get(API_KEY_ENV)) or None


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """The ``Authorization`` header a caller with ``api_key`` sends (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def bearer_matches(authorization: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header carries ``api_key`` (constant time)."""
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {api_key}".encode())


def refusal(setting: str) -> dict[str, Any]:
    """The 401 body (vLLM's error shape) for a missing or wrong token; ``setting``
    names where the server's token comes from."""
    message = (
        f"missing or wrong bearer token: this server requires its token ({setting}); give the trainer "
        f"the same key (api_key: in the weight_sync config, or {API_KEY_ENV} in its environment)"
    )
    return {"error": {"message": message, "type": "AuthenticationError", "param": None, "code": 401}}
