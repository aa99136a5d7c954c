"""LoRA adapters the reference receiver serves, as vLLM serves them (``/v1/load_lora_adapter``).

An adapter round writes its version to this host's disk like inside vLLM
(the worker engine, ``wt_callbacks.lora.files``); ``load`` then reads a
version, by its ``wt-lora://`` reference or a plain directory, and requests
naming the adapter are served by a copy of the model with it applied
(``wt_callbacks.lora.apply``). The receiver reads a version once and keeps
it in memory, so the files of a version its own round wrote are removed
once read (vLLM, which re-reads them, keeps them: ``integrations/vllm_lora``). As in vLLM, the adapter is applied to the
base weights the receiver holds when it serves: after a base-weight round,
the next request rebuilds the copy from the new base. ``checksums`` are the
sha256 of each loaded adapter tensor, as received.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wt_callbacks.checksums import tensor_sha256
from wt_callbacks.lora import files
from wt_callbacks.lora.apply import adapted_copy


class AdapterNotFound(LookupError):
    """No adapter or version by that name (HTTP 404, as vLLM answers)."""


@dataclass
class _Loaded:
    path: str
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    model: torch.nn.Module | None = None
    built_for: int = -1
    checksums: dict[str, str] = field(default_factory=dict)


class ServedAdapters:
    """The adapters loaded into one receiver, by name."""

    def __init__(self) -> None:
        self._loaded: dict[str, _Loaded] = {}

    def load(self, name: str, path: str) -> None:
        """Load the version at ``path`` (``wt-lora://`` or a directory) as ``name``, replacing any before it.

        Raises:
            AdapterNotFound: nothing is written at ``path``.
            ValueError: a bad reference or name.
        """
        files.check_component("lora_name", name)
        directory = files.resolve(path)[1] if path.startswith(files.SCHEME) else Path(path)
        if not (directory / files.WEIGHTS_FILE).is_file():
            raise AdapterNotFound(f"No adapter found for {name} at {path}")
        tensors, config = files.read_version(directory)
        if path.startswith(files.SCHEME):
            # A version this receiver's own round wrote: held in memory from
            # now on, so its files go (a long run would fill the disk).
            files.remove_version(directory)
        checksums = {n: tensor_sha256(t) for n, t in tensors.items()}
        self._loaded[name] = _Loaded(path, tensors, config, checksums=checksums)

    def unload(self, name: str) -> None:
        if self._loaded.pop(name, None) is None:
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")

    def names(self) -> list[tuple[str, str]]:
        """``(name, path)`` of every loaded adapter."""
        return [(n, a.path) for n, a in self._loaded.items()]

    def __contains__(self, name: str) -> bool:
        return name in self._loaded

    def model(self, name: str, base: torch.nn.Module, base_version: int) -> torch.nn.Module:
        """The copy of ``base`` serving adapter ``name``, rebuilt when the base changed (``base_version``)."""
        loaded = self._loaded[name]
        if loaded.model is None or loaded.built_for != base_version:
            loaded.model = adapted_copy(base, loaded.tensors, loaded.config).eval()
            loaded.built_for = base_version
        return loaded.model

    def checksums(self) -> dict[str, dict[str, Any]]:
        return {n: {"path": a.path, "checksums": dict(a.checksums)} for n, a in self._loaded.items()}
