"""HTTP guard for a vLLM server's weight routes, the same token as ``--api-key``.

vLLM's ``--api-key`` (``VLLM_API_KEY``) guards only ``/v1``, ``/v2``,
``/inference`` and ``/cohere``: with dev mode on, its RL routes
(``/init_weight_transfer_engine``, ``/update_weights``, ``/pause``,
``/collective_rpc`` ...) answer anyone who reaches the port. Started with::

    --middleware wt_callbacks.integrations.vllm_auth.require_token

every route but ``/health`` wants ``Authorization: Bearer $VLLM_API_KEY``
and answers 401 naming the setting otherwise. Without ``VLLM_API_KEY`` in the
server's environment it lets every request through (the worker engine's own
check then has no token either).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from wt_callbacks.transfer.auth import bearer_matches, refusal
from wt_callbacks.transfer.auth import API_KEY_ENV, api_key_or_env

async def require_token(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """vLLM ``--middleware`` (an http middleware function, as FastAPI's)."""
    api_key = api_key_or_env(None)
    path = request.url.path.removeprefix(request.scope.get("root_path", ""))
    if api_key is None or path == "/health" or request.method == "OPTIONS":
        return await call_next(request)
    if bearer_matches(request.headers.get("authorization"), api_key):
        return await call_next(request)
    from starlette.responses import JSONResponse

    return JSONResponse(status_code=401, content=refusal(f"{API_KEY_ENV} in the server's environment"))
