"""Control-plane clients: how the trainer talks to inference servers.

``HTTPVLLMWeightSyncClient`` speaks vLLM's RL HTTP routes (dev mode);
``RayVLLMWeightSyncClient`` calls the same methods on ``LLM``/``AsyncLLM``
Ray actors (or our ``RayReceiver``). Both implement ``VLLMWeightSyncClient``.

Several servers are driven as one unit: every call fans out concurrently and
fails if any server fails. At init each independent server gets its own
``rank_offset`` in one transfer group (``server_group``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

from wt_callbacks.transfer.auth import API_KEY_ENV, api_key_or_env, bearer_headers
from wt_callbacks.transfer.base import (
    WeightTransferError,
    WeightTransferUpdatePayload,
)
from wt_callbacks.transfer.ray_client import RayVLLMWeightSyncClient
from wt_callbacks.transfer.server_group import assign_rank_offsets, servers_and_workers
from wt_callbacks.transfer.validation import check_positive, check_server_urls

__all__ = ["HTTPVLLMWeightSyncClient", "RayVLLMWeightSyncClient", "WeightSyncHTTPError"]

T = TypeVar("T")

PAUSE_MODES = ("abort", "wait", "keep")

DEV_MODE_HINT = (
    "the server does not serve vLLM's weight-transfer routes: start vLLM with "
    "VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{\"backend\": \"torch_dist\"}' "
    "(and wt-callbacks installed in its environment)"
)


class WeightSyncHTTPError(WeightTransferError):
    """A server answered an RL route with an error status, or not at all."""

    def __init__(self, message: str, *, url: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.url = url
        self.status = status
        self.body = body


class _FanOut:
    """Runs one call per server concurrently; raises the first failure."""

    def __init__(self, n: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="wt-fanout") if n > 1 else None

    def map(self, fn: Callable[[int], T], n: int) -> list[T]:
        if self._pool is None:
            return [fn(i) for i in range(n)]
        futures = [self._pool.submit(fn, i) for i in range(n)]
        errors = [f.exception() for f in futures]
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]
        return [f.result() for f in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class HTTPVLLMWeightSyncClient:
    """Talks to one or more vLLM servers over the RL HTTP routes.

    Args:
        base_url: ``"http://host:port"`` or a list of them (driven as one
            unit: concurrent fan-out, distinct ``rank_offset`` per server).
        timeout: seconds per request (connect + read).
        timeouts: per-method overrides, e.g. ``{"update_weights": 900}``;
            keys are this class's method names.
        api_key: the servers' token: sent as a bearer token (what vLLM's
            ``--api-key`` checks) and proven to the worker engine at init
            (``torch_dist``'s ``session_proof``); defaults to the
            ``VLLM_API_KEY`` environment variable.

    Errors raise ``WeightSyncHTTPError`` carrying the URL, the status and the
    server's response body. A 404 on a weight route means the server runs
    without ``VLLM_SERVER_DEV_MODE=1`` (or without a weight-transfer config)
    and says so.
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        timeout: float = 300,
        *,
        timeouts: Mapping[str, float] | None = None,
        api_key: str | None = None,
    ) -> None:
        import requests

        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("base_url: give at least one server URL")
        check_server_urls("base_url", urls)
        check_positive("timeout", timeout)
        unknown = set(timeouts or {}) - {
            n for n, v in vars(type(self)).items() if not n.startswith("_") and callable(v)
        }
        if unknown:
            raise ValueError(f"timeouts: unknown method names {sorted(unknown)}")
        for call, value in (timeouts or {}).items():
            check_positive(f"timeouts[{call!r}]", value)  # None too: every call has a timeout
        self.base_urls = [u.rstrip("/") for u in urls]
        self.timeout = float(timeout)
        self.timeouts = dict(timeouts or {})
        self.api_key = api_key_or_env(api_key)
        self._headers = bearer_headers(self.api_key)
        self._sessions = [requests.Session() for _ in self.base_urls]
        self._fan_out = _FanOut(len(self.base_urls))
        self._world_sizes: list[int] | None = None

    @property
    def base_url(self) -> str:
        """The first server's URL (the seed's single-server attribute)."""
        return self.base_urls[0]

    # -- transport ---------------------------------------------------------

    def _request(
        self,
        i: int,
        method: str,
        path: str,
        *,
        call: str,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        not_found: str = DEV_MODE_HINT,
    ) -> Any:
        import requests

        url = f"{self.base_urls[i]}/{path}"
        timeout = self.timeouts.get(call, self.timeout)
        try:
            response = self._sessions[i].request(
                method, url, json=json, params=params, headers=self._headers, timeout=timeout
            )
        except requests.Timeout as e:
            raise WeightSyncHTTPError(
                f"{method} {url}: no answer within {timeout:g} s "
                f"(raise timeouts['{call}'] if the server is just slow)",
                url=url,
            ) from e
        except requests.ConnectionError as e:
            raise WeightSyncHTTPError(
                f"{method} {url}: cannot reach the server ({e.__class__.__name__}); "
                "check that it is running and that the URL is right",
                url=url,
            ) from e
        if response.status_code >= 400:
            body = response.text[:2000]
            if response.status_code >= 500:
                # vLLM's server (uvicorn) closes the connection after a route
                # raised; reusing the pooled one would fail the next call with
                # a spurious ConnectionError. Drop the pool: the next call reconnects.
                self._sessions[i].close()
            if response.status_code == 404:
                detail = not_found
            elif response.status_code in (401, 403):
                detail = f"the server refused the token: pass api_key= or set {API_KEY_ENV}"
            else:
                detail = "the server rejected the call"
            raise WeightSyncHTTPError(
                f"{method} {url} -> HTTP {response.status_code}: {detail}. Response body: {body}",
                url=url,
                status=response.status_code,
                body=body,
            )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    def _all(self, method: str, path: str, *, call: str, json: Any = None, params: Any = None) -> list[Any]:
        return self._fan_out.map(
            lambda i: self._request(i, method, path, call=call, json=json, params=params),
            len(self.base_urls),
        )

    # -- VLLMWeightSyncClient ---------------------------------------------

    def init_payloads(self, init_info: dict[str, Any]) -> list[dict[str, Any]]:
        """The ``init_info`` each server gets: its own ``rank_offset`` (see
        ``assign_rank_offsets``); one server takes it as it is, once its
        workers fit the group (``_check_ranks_fit``)."""
        if len(self.base_urls) == 1:
            self._check_ranks_fit(init_info)
            return [dict(init_info)]
        return assign_rank_offsets(init_info, self.world_sizes(), self.base_urls)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """POST ``/init_weight_transfer_engine`` to every server, each with its
        own ``rank_offset`` (``init_payloads``)."""
        payloads = self.init_payloads(init_info)
        self._fan_out.map(
            lambda i: self._request(
                i,
                "POST",
                "init_weight_transfer_engine",
                call="init_weight_transfer_engine",
                json={"init_info": payloads[i]},
            ),
            len(self.base_urls),
        )

    def _check_ranks_fit(self, init_info: Mapping[str, Any]) -> None:
        """One server (whose group may hold other servers, driven by other
        clients): its workers' ranks ``rank_offset`` .. ``rank_offset +
        workers - 1`` must lie in the group, past the trainer's rank 0, or
        the call fails here, before the server is called."""
        if "rank_offset" not in init_info or "world_size" not in init_info:
            return
        first, world_size = int(init_info["rank_offset"]), int(init_info["world_size"])
        (workers,) = self.world_sizes()
        if first < 1 or first + workers > world_size:
            raise ValueError(
                f"init_info rank_offset={first}, world_size={world_size} do not fit the server "
                f"({servers_and_workers(self.base_urls, [workers])}): its workers take ranks rank_offset.."
                f"rank_offset+{workers - 1} and rank 0 is the trainer, so rank_offset must be at least 1 and "
                f"world_size at least rank_offset + {workers}"
            )

    def start_weight_update(self) -> None:
        self._all("POST", "start_weight_update", call="start_weight_update")

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self._all("POST", "update_weights", call="update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self._all("POST", "finish_weight_update", call="finish_weight_update", json=body)

    # -- helpers outside the protocol -------------------------------------

    def shutdown_weight_transfer_engine(self) -> None:
        self._all("POST", "shutdown_weight_transfer_engine", call="shutdown_weight_transfer_engine")

    def pause(self, mode: str = "keep", *, clear_cache: bool = True) -> None:
        """Pause generation on every server (``abort`` | ``wait`` | ``keep``)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        params = {"mode": mode, "clear_cache": str(clear_cache).lower()}
        self._all("POST", "pause", call="pause", params=params)

    def resume(self) -> None:
        self._all("POST", "resume", call="resume")

    def is_paused(self) -> list[bool]:
        return [bool(r["is_paused"]) for r in self._all("GET", "is_paused", call="is_paused")]

    def world_sizes(self) -> list[int]:
        """Each server's inference world size (TP*PP*DP), asked once and cached."""
        if self._world_sizes is None:
            answers = self._all("GET", "get_world_size", call="get_world_size", params={"include_dp": "true"})
            self._world_sizes = [int(a["world_size"]) for a in answers]
        return list(self._world_sizes)

    def get_world_size(self) -> int:
        """Total inference world size over all servers (the group holds 1 + this)."""
        return sum(self.world_sizes())

    def server_hosts(self) -> list[str]:
        """Each server's host, as its URL names it: where a trainer engine's
        group must be reachable from (``torch_dist`` advertises the address
        this host reaches them from)."""
        return [str(urlsplit(u).hostname) for u in self.base_urls]

    def weight_info(self) -> list[dict[str, Any]]:
        """``GET /weight_info`` of every server, in ``base_urls`` order."""
        return self._all("GET", "weight_info", call="weight_info")

    def update_weight_version(self, new_version: str) -> None:
        self._all("POST", "update_weight_version", call="update_weight_version", json={"new_version": new_version})

    def server_info(self) -> list[dict[str, Any] | None]:
        """``GET /server_info?config_format=json`` of every server (vLLM's
        config and environment, dev mode), ``None`` for a server without it."""

        def one(i: int) -> dict[str, Any] | None:
            try:
                return self._request(i, "GET", "server_info", call="server_info", params={"config_format": "json"})
            except WeightSyncHTTPError as e:
                if e.status == 404:
                    return None
                raise

        return self._fan_out.map(one, len(self.base_urls))

    def load_lora_adapter(self, lora_name: str, lora_paths: Sequence[str]) -> None:
        """``POST /v1/load_lora_adapter`` on every server: ``lora_paths[i]`` as
        ``lora_name`` on server ``i``, replacing the adapter already under that name."""
        if len(lora_paths) != len(self.base_urls):
            raise ValueError(f"lora_paths has {len(lora_paths)} entries for {len(self.base_urls)} servers")
        hint = "no such route or adapter (the route needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora)"
        self._fan_out.map(
            lambda i: self._request(
                i, "POST", "v1/load_lora_adapter", call="load_lora_adapter", not_found=hint,
                json={"lora_name": lora_name, "lora_path": lora_paths[i], "load_inplace": True},
            ),
            len(self.base_urls),
        )  # fmt: skip

    def close(self) -> None:
        self._fan_out.close()
        for s in self._sessions:
            s.close()
