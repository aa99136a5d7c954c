"""The receiver over HTTP: vLLM's RL routes (and greedy completions) around a ``ReceiverCore``."""

import errno
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import torch

from wt_callbacks.receiver.adapters import AdapterNotFound
from wt_callbacks.receiver.core import COMPLETION_PAUSE_WAIT_S, BadRequest, ReceiverCore
from wt_callbacks.transfer.auth import (
    API_KEY_ENV,
    api_key_or_env,
    bearer_matches,
    refusal,
)
from wt_callbacks.transfer.clients import PAUSE_MODES

logger = logging.getLogger(__name__)

PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
"""vLLM 0.33's answer (503) to a new request while paused with ``abort`` or ``wait``."""
MAX_ADAPTER_RANK = 1 << 16
"""The LoRA rank this receiver reports it serves: any (it applies adapters to a copy of its model)."""


def _error(status: int, message: str) -> Any:
    from fastapi.responses import JSONResponse

    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
        status, "InternalServerError" if status >= 500 else HTTPStatus(status).phrase
    )
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": None, "code": status}},
    )


def build_app(core: ReceiverCore, model_name: str = "receiver", *, api_key: str | None = None) -> Any:
    """The FastAPI app serving vLLM's RL routes (and greedy completions) over ``core``.

    With ``api_key`` every route but ``/health`` requires ``Authorization:
    Bearer <api_key>`` and answers 401 without it (vLLM's ``--api-key``
    leaves its weight routes open; this receiver guards them all).
    """
    import anyio
    from fastapi import Body, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="wt_callbacks reference receiver")

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> Any:
        return _error(400, str(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Any:
        # vLLM's shape, not FastAPI's {"detail": ...}; with the cause, as "There
        # was an error parsing the body" alone does not say what is wrong.
        cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
        return _error(exc.status_code, f"{exc.detail}{cause}")

    @app.exception_handler(BadRequest)
    async def refused(_: Request, exc: BadRequest) -> Any:
        return _error(400, str(exc))

    @app.exception_handler(AdapterNotFound)
    async def not_found(_: Request, exc: AdapterNotFound) -> Any:
        return _error(404, str(exc))

    @app.middleware("http")
    async def errors_as_500(request: Request, call_next: Callable) -> Any:
        # vLLM loses the exception type across processes and answers 500.
        # Answering here (not in an `Exception` handler, which re-raises)
        # keeps the keep-alive connection usable for the next call.
        try:
            return await call_next(request)
        except Exception as exc:  # noqa: BLE001 - every route error becomes a 500 answer
            logger.warning("%s failed: %s", request.url.path, exc)
            return _error(500, f"{type(exc).__name__}: {exc}")

    if api_key:

        @app.middleware("http")
        async def require_token(request: Request, call_next: Callable) -> Any:
            # Added last, so it runs first: a refused call reaches no route.
            if request.url.path != "/health" and not bearer_matches(request.headers.get("authorization"), api_key):
                return JSONResponse(status_code=401, content=refusal(f"--api-key or {API_KEY_ENV}"))
            return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/init_weight_transfer_engine")
    def init_weight_transfer_engine(init_info: dict[str, Any] = Body(..., embed=True)) -> dict:
        core.init_weight_transfer_engine(init_info)
        return {"message": "Weight transfer initialized"}

    @app.post("/shutdown_weight_transfer_engine")
    def shutdown_weight_transfer_engine() -> dict:
        core.shutdown_weight_transfer_engine()
        return {"message": "Weight transfer shut down"}

    @app.post("/start_weight_update")
    def start_weight_update() -> dict:
        core.start_weight_update()
        return {"message": "Weight update started"}

    @app.post("/start_draft_weight_update")
    def start_draft_weight_update() -> dict:
        raise RuntimeError("This server has no draft model: draft weight updates are not supported.")

    @app.post("/update_weights")
    def update_weights(update_info: dict[str, Any] | list[dict[str, Any]] = Body(..., embed=True)) -> dict:
        core.update_weights(update_info)
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> Any:
        raw = await request.body()
        version = None
        if raw:
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
                return _error(400, f"body must be {{\"weight_version\": str}} or empty; it does not parse as JSON: {e}")
            if not isinstance(body, dict) or not isinstance(body.get("weight_version", ""), (str, type(None))):
                return _error(400, "body must be {\"weight_version\": str}")
            version = body.get("weight_version")
        # Off the event loop: finishing copies the staged weights.
        await anyio.to_thread.run_sync(core.finish_weight_update, version)
        return {"message": "Weight update finished"}

    @app.post("/collective_rpc")
    def collective_rpc(
        method: str = Body(...),
        args: list[Any] = Body(default_factory=list),
        kwargs: dict[str, Any] = Body(default_factory=dict),
        timeout: float | None = Body(None),
    ) -> Any:
        # vLLM dispatches any worker method here; the one a weight-sync setup
        # uses is the reload-from-disk alternative to pushing.
        if method != "reload_weights":
            return _error(400, f"method {method!r} is not supported here; this receiver serves 'reload_weights'")
        core.reload_weights(*args, **kwargs)
        return {"results": [None]}

    @app.post("/update_weight_version")
    def update_weight_version(new_version: str = Body(..., embed=True)) -> dict:
        core.update_weight_version(new_version)
        return {"success": True, "new_version": new_version}

    @app.get("/weight_info")
    async def weight_info() -> dict:
        return core.weight_info()

    @app.get("/weight_checksums")
    def weight_checksums() -> dict:
        return core.weight_checksums()

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True) -> dict:
        return {"world_size": 1}

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True) -> Any:
        if mode not in PAUSE_MODES:
            return JSONResponse(status_code=400, content={"error": f"Invalid mode {mode!r}; use one of {PAUSE_MODES}"})
        core.pause(mode)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict:
        core.resume()
        return {"status": "resumed"}

    @app.get("/v1/models")
    async def models() -> dict:
        adapters = [{"id": n, "object": "model", "root": p, "parent": model_name} for n, p in core.adapters.names()]
        return {"object": "list", "data": [{"id": model_name, "object": "model"}, *adapters]}

    @app.post("/v1/load_lora_adapter")
    def load_lora_adapter(lora_name: str = Body(...), lora_path: str = Body(...), load_inplace: bool = Body(False)) -> Any:
        if lora_name == model_name:
            return _error(400, f"The lora adapter '{lora_name}' conflicts with a served base model.")
        if lora_name in core.adapters and not load_inplace:
            return _error(400, f"The lora adapter '{lora_name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.")
        try:
            core.load_lora_adapter(lora_name, lora_path)
        except ValueError as e:
            return _error(400, str(e))
        return Response(status_code=200, content=f"Success: LoRA adapter '{lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    def unload_lora_adapter(lora_name: str = Body(..., embed=True)) -> Any:
        core.unload_lora_adapter(lora_name)
        return Response(status_code=200, content=f"Success: LoRA adapter '{lora_name}' removed successfully.")

    @app.get("/server_info")
    async def server_info() -> dict:
        # The part of vLLM's answer a trainer reads: adapters are served at any rank.
        return {
            "vllm_config": {"lora_config": {"max_lora_rank": MAX_ADAPTER_RANK}, "device_config": {"device": str(core.engine.device)}},
            "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True},
        }

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any] = Body(...)) -> Any:
        prompts = _prompts(body.get("prompt"))
        if prompts is None:
            return _error(400, "prompt must be a string, a list of strings, token ids or a list of token-id lists")
        # Unlike vLLM, a request without a temperature is decoded greedily.
        temperature = body.get("temperature") or 0.0
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
            return _error(400, "temperature must be a number >= 0 (0: greedy)")
        for key, default in (("max_tokens", 16), ("n", 1)):
            value = body.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                return _error(400, f"{key} must be a positive integer")
        requested = body.get("model")
        adapter = requested if requested not in (None, model_name) else None
        if adapter is not None and adapter not in core.adapters:
            return _error(404, f"The model `{requested}` does not exist.")
        if core.refuses_new_requests:
            return _error(503, PAUSED_MESSAGE)
        # Wait out a `keep` pause here, on the event loop: a worker thread parked
        # per waiting request could starve the weight routes that end the pause.
        for _ in range(int(COMPLETION_PAUSE_WAIT_S / 0.01)):
            if not core.paused:
                break
            await anyio.sleep(0.01)
        choices = await anyio.to_thread.run_sync(
            lambda: core.complete(
                prompts,
                body.get("max_tokens", 16),
                logprobs=body.get("logprobs") is not None,
                ignore_eos=bool(body.get("ignore_eos", False)),
                tokens_as_ids=bool(body.get("return_tokens_as_token_ids", False)),
                temperature=float(temperature),
                n=body.get("n", 1),
                adapter=adapter,
            )
        )
        return {"object": "text_completion", "model": requested or model_name, "choices": choices}

    @app.get("/is_paused")
    async def is_paused() -> dict:
        return {"is_paused": core.paused}

    return app


class Receiver:
    """Serves ``model`` on vLLM's RL routes from a background thread.

    ``api_key`` (default: ``VLLM_API_KEY`` from the environment): the token
    every route but ``/health`` requires, and that the worker engine checks
    before it joins a transfer group. Without one, any caller is served.

    Example::

        with Receiver(model) as receiver:
            url = receiver.start()          # "http://127.0.0.1:<free port>"
            ...                             # point the trainer at url
    """

    def __init__(
        self, model: torch.nn.Module, *, backend: str = "torch_dist", tokenizer: Any = None,
        model_name: str = "receiver", api_key: str | None = None,
    ) -> None:  # fmt: skip
        self.api_key = api_key_or_env(api_key)
        self.core = ReceiverCore(model, backend=backend, tokenizer=tokenizer, api_key=self.api_key)
        self.model_name = model_name
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.core.model

    def start(self, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 30.0) -> str:
        """Start serving; returns the base URL. ``port=0`` picks a free port."""
        import uvicorn

        if self._thread is not None:
            raise RuntimeError(f"the receiver is already serving on {self.url}")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted sockets inherit it: without it, a keep-alive response
        # written in two parts waits ~40 ms on the client's delayed ACK.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            # Any other error (a name that does not resolve, an address of
            # another machine) is the host's, not the port's.
            in_use = e.errno in (errno.EADDRINUSE, errno.EACCES)
            fix = "choose another --port" if in_use else "--host must be an address of this machine"
            raise OSError(f"receiver cannot listen on {host}:{port}: {e}; {fix}") from e
        app = build_app(self.core, self.model_name, api_key=self.api_key)
        config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="wt-receiver", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            self.stop()
            raise RuntimeError(f"receiver did not start on {host}:{port} within {timeout_s:g} s")
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        return self.url

    def stop(self) -> None:
        """Stop serving and leave any transfer group."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server, self._thread = None, None
        self.core.shutdown()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _prompts(prompt: Any) -> list[str | list[int]] | None:
    """vLLM's prompt forms as a list of prompts, or None when it is none of them."""
    def is_ids(value: Any) -> bool:
        return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

    if isinstance(prompt, str) or is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        return list(prompt)
    return None
