"""Reference receiver: vLLM's RL weight-sync routes around any torch module.

It runs the same worker engines vLLM loads through our plugin, behind the
same routes, payloads and status codes, so a trainer cannot tell it from a
vLLM server as far as weight sync goes. Use it to develop and test a training
setup without vLLM, in CI, and in the quickstart.

Beyond vLLM it reports ``updates_completed`` and ``version_history`` in
``GET /weight_info`` and serves ``GET /weight_checksums`` (sha256 per
parameter) so a test can prove a sync was bitwise exact. Updates are
transactional: tensors are staged during a round and copied into the model
only when ``finish_weight_update`` succeeds; an interrupted round leaves the
old weights in place. ``POST /collective_rpc`` serves vLLM's
``reload_weights`` (load ``*.safetensors`` from a directory), the
reload-from-disk alternative to pushing.

Three ways to run it:

* Python: ``with Receiver(model) as r: url = r.start()``.
* CLI: ``python -m wt_callbacks.receiver --model DIR`` (a transformers
  causal LM) or ``--module-factory pkg.module:function``.
* Ray: ``ray.remote(RayReceiver).remote(model_dir_or_module)``, with the
  methods vLLM's ``LLM`` actors expose.
"""

import argparse
import importlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from wt_callbacks.checksums import module_checksums
from wt_callbacks.transfer.base import (
    WeightTransferConfig,
    WeightTransferInitRequest,
    WeightTransferUpdatePayload,
    WeightTransferUpdateRequest,
    dtype_from_name,
    dtype_name,
)
from wt_callbacks.transfer.clients import PAUSE_MODES
from wt_callbacks.transfer.factory import WeightTransferEngineFactory

logger = logging.getLogger(__name__)

COMPLETION_PAUSE_WAIT_S = 300.0
"""How long a completion request waits for a paused receiver to resume."""


class StagedWeights:
    """Weight-update target that stages a round and applies it on commit.

    Given to the worker engine through ``set_weight_update_target``: the
    engine calls ``validate_update`` before receiving and ``load_weights``
    while receiving, exactly as it would call a vLLM model.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._params = dict(model.named_parameters())
        self._staged: dict[str, torch.Tensor] = {}

    def validate_update(
        self, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[tuple[int, ...]]
    ) -> None:
        unknown = [n for n in names if n not in self._params]
        if unknown:
            raise ValueError(
                f"{len(unknown)} parameter name(s) not in the served model, e.g. {unknown[:3]}; "
                f"the model has e.g. {list(self._params)[:3]}. Check the trainer's module / name "
                "prefixes (select the submodule that holds the checkpoint)"
            )
        for name, dtype, shape in zip(names, dtypes, shapes):
            param = self._params[name]
            if tuple(param.shape) != tuple(shape):
                raise ValueError(
                    f"shape mismatch for {name!r}: trainer sends {list(shape)}, the served model has "
                    f"{list(param.shape)}"
                )
            if dtype.is_floating_point != param.dtype.is_floating_point:
                raise ValueError(
                    f"dtype mismatch for {name!r}: trainer sends {dtype_name(dtype)}, the served "
                    f"model has {dtype_name(param.dtype)}"
                )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            param = self._params.get(name)
            if param is None:
                raise ValueError(f"parameter {name!r} is not in the served model")
            # Received tensors are views into the round's receive buffers:
            # staging keeps them as they are. A wire dtype other than the
            # model's is converted by ``copy_`` at commit, in the same pass as
            # the copy, rather than into a fresh model-sized allocation here.
            self._staged[name] = tensor

    def commit(self) -> None:
        with torch.no_grad():
            for name, tensor in self._staged.items():
                self._params[name].copy_(tensor)
        self._staged.clear()


def _host_config(world_size: int = 1) -> SimpleNamespace:
    """The slice of vLLM's ``VllmConfig`` a worker engine reads."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=world_size, rank=0),
        model_config=None,
    )


class ReceiverCore:
    """Lifecycle of weight updates around one model (shared by HTTP and Ray).

    Misuse answers as vLLM does: update or finish without start, and a second
    start, raise ``RuntimeError``; a failed update ends the session.
    """

    def __init__(self, model: torch.nn.Module, *, backend: str = "torch_dist", tokenizer: Any = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend=backend), _host_config(), device, model
        )
        self.weight_version = "default"
        self.version_history: list[str] = []
        self.updates_completed = 0
        self._stage: StagedWeights | None = None
        # One weight operation at a time, as vLLM's engine core runs them;
        # generation takes it too, so it never sees a half-applied round.
        self._lock = threading.Lock()
        self._unpaused = threading.Event()
        self._unpaused.set()

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    def pause(self) -> None:
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()

    def complete(self, prompts: Sequence[str], max_tokens: int, logprobs: bool) -> list[dict[str, Any]]:
        """Greedy completions (what the quickstart and tests ask a server for).

        Refused while paused: the HTTP route waits out a pause before calling
        this (vLLM's ``keep``/``wait`` behaviour for new requests).
        """
        if self.tokenizer is None or not callable(getattr(self.model, "generate", None)):
            raise ValueError("this receiver serves no completions: it needs a transformers model and tokenizer")
        if self.paused:
            raise TimeoutError(f"generation stayed paused for more than {COMPLETION_PAUSE_WAIT_S:g} s")
        choices = []
        with self._lock, torch.no_grad():
            for index, prompt in enumerate(prompts):
                ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"].to(self.engine.device)
                out = self.model.generate(
                    ids,
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=self.tokenizer.pad_token_id,
                )
                new_ids = out.sequences[0, ids.shape[1] :].tolist()
                choice: dict[str, Any] = {
                    "index": index,
                    "text": self.tokenizer.decode(new_ids, skip_special_tokens=True),
                    "finish_reason": "length" if len(new_ids) == max_tokens else "stop",
                }
                if logprobs:
                    steps = [torch.log_softmax(logit[0].float(), dim=-1) for logit in out.logits]
                    choice["logprobs"] = {
                        "tokens": self.tokenizer.convert_ids_to_tokens(new_ids),
                        "token_logprobs": [step[t].item() for step, t in zip(steps, new_ids)],
                    }
                choices.append(choice)
        return choices

    def init_weight_transfer_engine(self, init_info: Mapping[str, Any]) -> None:
        with self._lock:
            self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def shutdown_weight_transfer_engine(self) -> None:
        with self._lock:
            if self._stage is not None:
                raise RuntimeError("Cannot shut down weight transfer while a weight update is active.")
            self.engine.shutdown()

    def start_weight_update(self) -> None:
        with self._lock:
            if self._stage is not None:
                raise RuntimeError("A weight update is already active. Call finish_weight_update first.")
            stage = StagedWeights(self.model)
            self.engine.set_weight_update_target(stage, None)
            try:
                self.engine.start_weight_update()
            except Exception:
                self.engine.reset_weight_update_target()
                raise
            self._stage = stage

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        with self._lock:
            if self._stage is None:
                raise RuntimeError("start_weight_update must be called before update_weights.")
            local = update_info[0] if isinstance(update_info, list) else update_info
            try:
                self.engine.update_weights(local)
            except Exception:
                self._stage = None
                self.engine.reset_weight_update_target()
                raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        with self._lock:
            if self._stage is None:
                raise RuntimeError("finish_weight_update called without an active weight update.")
            self.engine.finish_weight_update()
            self._stage.commit()
            self._stage = None
            self.engine.reset_weight_update_target()
            if weight_version is not None:
                self.weight_version = weight_version
            self.updates_completed += 1
            self.version_history.append(self.weight_version)

    def reload_weights(self, weights_path: str) -> None:
        """Load every ``*.safetensors`` file in ``weights_path`` (vLLM's
        ``reload_weights`` collective RPC: the reload-from-disk way to sync).

        Validated and applied like a pushed round (all or nothing), but it
        does not change ``weight_version`` or count as an update: vLLM's
        reload does neither.
        """
        from pathlib import Path

        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise RuntimeError("reload_weights needs safetensors: pip install 'wt-callbacks[receiver]'") from e
        files = sorted(Path(weights_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"weights_path={weights_path!r} has no *.safetensors file")
        with self._lock:
            if self._stage is not None:
                raise RuntimeError("Cannot reload weights while a weight update is active.")
            stage = StagedWeights(self.model)
            for file in files:
                tensors = load_file(file)
                stage.validate_update(list(tensors), [t.dtype for t in tensors.values()], [tuple(t.shape) for t in tensors.values()])
                stage.load_weights(tensors.items())
            stage.commit()

    def update_weight_version(self, new_version: str) -> None:
        self.weight_version = new_version

    def weight_info(self) -> dict[str, Any]:
        return {
            "weight_version": self.weight_version,
            "updates_completed": self.updates_completed,
            "version_history": list(self.version_history),
        }

    def weight_checksums(self) -> dict[str, Any]:
        with self._lock:
            return {"weight_version": self.weight_version, "checksums": module_checksums(self.model)}

    def shutdown(self) -> None:
        self.engine.shutdown()


def _error(status: int, message: str) -> Any:
    from fastapi.responses import JSONResponse

    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": None, "code": status}},
    )


def build_app(core: ReceiverCore, model_name: str = "receiver") -> Any:
    """The FastAPI app serving vLLM's RL routes (and greedy completions) over ``core``."""
    import anyio
    from fastapi import Body, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response

    app = FastAPI(title="wt_callbacks reference receiver")

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> Any:
        return _error(400, str(exc.errors()))

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
            body = await request.json()
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
        core.pause()
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict:
        core.resume()
        return {"status": "resumed"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any] = Body(...)) -> Any:
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            return _error(400, "prompt must be a string or a list of strings")
        if body.get("temperature", 0) not in (0, 0.0, None):
            return _error(400, "the reference receiver decodes greedily only: use temperature 0")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, "max_tokens must be a positive integer")
        # Wait out a pause here, on the event loop: a worker thread parked per
        # waiting request could starve the weight routes that end the pause.
        for _ in range(int(COMPLETION_PAUSE_WAIT_S / 0.01)):
            if not core.paused:
                break
            await anyio.sleep(0.01)
        choices = await anyio.to_thread.run_sync(
            lambda: core.complete(prompts, max_tokens, logprobs=body.get("logprobs") is not None)
        )
        return {"object": "text_completion", "model": model_name, "choices": choices}

    @app.get("/is_paused")
    async def is_paused() -> dict:
        return {"is_paused": core.paused}

    return app


class Receiver:
    """Serves ``model`` on vLLM's RL routes from a background thread.

    Example::

        with Receiver(model) as receiver:
            url = receiver.start()          # "http://127.0.0.1:<free port>"
            ...                             # point the trainer at url
    """

    def __init__(self, model: torch.nn.Module, *, backend: str = "torch_dist", tokenizer: Any = None, model_name: str = "receiver") -> None:
        self.core = ReceiverCore(model, backend=backend, tokenizer=tokenizer)
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
            raise OSError(f"receiver cannot listen on {host}:{port}: {e}; choose another --port") from e
        config = uvicorn.Config(build_app(self.core, self.model_name), log_level="warning", timeout_keep_alive=30)
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


def load_model(model: str | None = None, module_factory: str | None = None, dtype: str | None = None) -> torch.nn.Module:
    """Build the served model from a transformers directory or a factory path."""
    if (model is None) == (module_factory is None):
        raise ValueError("give exactly one of --model DIR or --module-factory pkg.module:function")
    torch_dtype = dtype_from_name(dtype, key="--dtype") if dtype else None
    if model is not None:
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": torch_dtype} if torch_dtype is not None else {}
        module = AutoModelForCausalLM.from_pretrained(model, **kwargs)
    else:
        module_path, _, attr = module_factory.partition(":")
        if not attr:
            raise ValueError(f"--module-factory {module_factory!r} must look like 'pkg.module:function'")
        factory: Callable[[], torch.nn.Module] = getattr(importlib.import_module(module_path), attr)
        module = factory()
        if torch_dtype is not None:
            module = module.to(torch_dtype)
    return module.eval()


class RayReceiver:
    """A receiver hosted in a Ray actor, with vLLM ``LLM``'s weight methods.

    Use as ``ray.remote(RayReceiver).remote(model_dir_or_module)``; drive it
    with ``RayVLLMWeightSyncClient``. Requests may be the request dataclasses
    or dicts of the form ``{"init_info": ...}`` / ``{"update_info": ...}``,
    as vLLM's ``LLM`` accepts.
    """

    def __init__(self, model_dir_or_module: str | torch.nn.Module, backend: str = "torch_dist", dtype: str | None = None) -> None:
        if isinstance(model_dir_or_module, torch.nn.Module):
            model = model_dir_or_module.eval()
        else:
            model = load_model(model=model_dir_or_module, dtype=dtype)
        self.core = ReceiverCore(model, backend=backend)

    def init_weight_transfer_engine(self, request: WeightTransferInitRequest | Mapping[str, Any]) -> None:
        info = request.init_info if isinstance(request, WeightTransferInitRequest) else request["init_info"]
        self.core.init_weight_transfer_engine(info)

    def start_weight_update(self) -> None:
        self.core.start_weight_update()

    def update_weights(self, request: WeightTransferUpdateRequest | Mapping[str, Any]) -> None:
        info = request.update_info if isinstance(request, WeightTransferUpdateRequest) else request["update_info"]
        self.core.update_weights(info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.core.finish_weight_update(weight_version)

    def update_weight_version(self, new_version: str) -> None:
        self.core.update_weight_version(new_version)

    def get_weight_version(self) -> str:
        return self.core.weight_version

    def get_world_size(self) -> int:
        return 1

    def weight_info(self) -> dict[str, Any]:
        return self.core.weight_info()

    def weight_checksums(self) -> dict[str, Any]:
        return self.core.weight_checksums()

    def shutdown_weight_transfer_engine(self) -> None:
        self.core.shutdown_weight_transfer_engine()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m wt_callbacks.receiver",
        description="Serve a model on vLLM's RL weight-sync routes (reference receiver).",
    )
    parser.add_argument("--model", help="transformers causal-LM directory (AutoModelForCausalLM)")
    parser.add_argument("--module-factory", help="pkg.module:function returning a torch.nn.Module")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--backend", default="torch_dist")
    parser.add_argument("--dtype", default=None, help="dtype to hold the weights in, e.g. bfloat16")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        model = load_model(args.model, args.module_factory, args.dtype)
    except ValueError as e:
        parser.error(str(e))
    tokenizer = None
    if args.model is not None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError) as e:
            logger.warning("no tokenizer in %s (%s): /v1/completions disabled", args.model, e)
    receiver = Receiver(model, backend=args.backend, tokenizer=tokenizer, model_name=args.model or args.module_factory)
    url = receiver.start(args.host, args.port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Tests and scripts read this line to learn the port.
    print(f"wt_callbacks receiver serving on {url}", flush=True)
    stop.wait()
    receiver.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
