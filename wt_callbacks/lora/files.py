"""Adapter versions on the server's disk: where each round's adapter lives and how it is written.

vLLM 0.32 loads an adapter only from a directory (``adapter_config.json`` and
``adapter_model.safetensors``); no API takes tensors. So the server side of
an adapter round (the vLLM plugin's worker engine, the reference receiver)
writes the tensors it received through the transfer group into a directory
of its own host (a trainer on another host needs no shared filesystem), and
the trainer then has the server load it by a reference, ``wt-lora://TAG/NAME/VERSION``,
which only the server resolves (``resolve``): the trainer never names a path
on the server.

Layout: ``<root>/<TAG>/<NAME>/<VERSION>/``, where

* ``root`` is ``$WT_LORA_DIR`` or ``<tmp>/wt_callbacks-lora-<uid>``, the same
  for every process of a server (API server, engine core, workers);
* ``TAG`` names the transfer session and the server in it: a hash of the
  session's secret (never the secret: paths show in ``/v1/models``) and the
  server's ``rank_offset``, so two servers of one session on one host keep
  separate versions;
* ``VERSION`` is the trainer's round count in the session: a new directory
  for every version, because vLLM keys its prefix cache on the adapter's path
  (a version loaded from a path an earlier one used would reuse the earlier
  one's cached blocks).

Every receiving process writes the round (workers of a TP group, DP engines,
two servers of one host): into a private temporary directory, renamed into
place in one step, so a reader sees a version whole or not at all, and a
second writer of the same bytes finds it done.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

LORA_DIR_ENV = "WT_LORA_DIR"
"""Where a server keeps adapter versions (default: a directory of the system's temporary directory)."""
SCHEME = "wt-lora://"
"""The adapter reference a trainer loads (``wt-lora://TAG/NAME/VERSION``)."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
"""A path component a reference may hold: no separator, no leading dot (no ``..``)."""


def lora_root() -> Path:
    """Where this host keeps adapter versions (``$WT_LORA_DIR``, else under the temporary directory)."""
    value = os.environ.get(LORA_DIR_ENV)
    return Path(value) if value else Path(tempfile.gettempdir()) / f"wt_callbacks-lora-{os.getuid()}"


def check_component(key: str, value: str) -> str:
    """``value`` if it can be one path component of an adapter version; ``ValueError`` naming ``key`` otherwise."""
    if not isinstance(value, str) or not _COMPONENT.fullmatch(value):
        raise ValueError(
            f"{key}={value!r} must be 1-128 characters of letters, digits, '_', '.' or '-', not starting with '.' or '-'"
        )
    return value


def session_tag(session_id: str | None, rank_offset: int) -> str:
    """The ``TAG`` of one server in one transfer session."""
    digest = hashlib.sha256(f"wt-lora:{session_id or ''}".encode()).hexdigest()[:16]
    return f"{digest}-{int(rank_offset)}"


def reference(tag: str, name: str, version: str) -> str:
    """The ``wt-lora://`` reference of one adapter version."""
    return f"{SCHEME}{tag}/{name}/{version}"


def resolve(ref: str, root: Path | None = None) -> tuple[str, Path]:
    """``(name, directory)`` of a ``wt-lora://TAG/NAME/VERSION`` reference on this host.

    Raises:
        ValueError: ``ref`` is not such a reference, or a component could
            leave the root (a separator, ``..``).
    """
    if not ref.startswith(SCHEME):
        raise ValueError(f"{ref!r} is not a {SCHEME}TAG/NAME/VERSION adapter reference")
    parts = ref[len(SCHEME) :].split("/")
    if len(parts) != 3:
        raise ValueError(f"{ref!r} is not a {SCHEME}TAG/NAME/VERSION adapter reference")
    tag, name, version = (check_component(k, v) for k, v in zip(("tag", "name", "version"), parts))
    return name, (root or lora_root()) / tag / name / version


def version_dir(session_id: str | None, rank_offset: int, name: str, version: str, root: Path | None = None) -> Path:
    """The directory one adapter version of a session is written to."""
    return resolve(reference(session_tag(session_id, rank_offset), name, version), root)[1]


def write_version(directory: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
    """Write one adapter version into ``directory``, atomically: it appears
    whole or not at all. A directory already there holds the same round,
    written by another process of the server: it is kept."""
    from safetensors.torch import save_file

    if (directory / WEIGHTS_FILE).is_file():
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(staging / WEIGHTS_FILE))
        (staging / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2, sort_keys=True))
        try:
            os.rename(staging, directory)
        except OSError:
            if not (directory / WEIGHTS_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def read_version(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and config of a written version."""
    from safetensors.torch import load_file

    return load_file(str(directory / WEIGHTS_FILE)), json.loads((directory / CONFIG_FILE).read_text())


def remove_version(directory: Path) -> None:
    """Delete one version (and its name's directory once empty)."""
    shutil.rmtree(directory, ignore_errors=True)
    try:
        directory.parent.rmdir()
    except OSError:
        pass


class AdapterVersion:
    """The target of an adapter round on the server side: the worker engine
    receives into it (``validate_update``, ``load_weights``, as into a model)
    and ``write()`` then puts the version on disk.

    Each tensor is copied as it arrives (the receive buffers are reused
    within the round); an adapter is small next to the model it adapts.
    """

    copies_loaded_tensors = True

    def __init__(self, directory: Path, config: Mapping[str, Any]) -> None:
        self.directory = directory
        self.config = dict(config)
        self.tensors: dict[str, torch.Tensor] = {}

    def validate_update(self, names: Any, dtypes: Any, shapes: Any) -> None:
        bad = next((n for n, d in zip(names, dtypes) if not d.is_floating_point), None)
        if bad is not None:
            raise ValueError(f"adapter tensor {bad!r} is not floating-point")
        if not names:
            raise ValueError("an adapter round must send at least one tensor")

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            self.tensors[name] = tensor.detach().clone()

    def write(self) -> None:
        write_version(self.directory, self.tensors, self.config)
