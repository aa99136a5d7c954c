"""Framework hyperparameters as a plain dict: where ``SyncConfig.from_hparams``
reads the ``weight_sync`` section from (a dict, an ``argparse.Namespace``, an
OmegaConf ``DictConfig``, a YAML file path or a JSON object string)."""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def field_or_near_miss(key: Any, fields: set[str]) -> bool:
    """Whether ``key`` is one of ``fields`` or a near miss of one (a typo)."""
    # 0.7, not difflib's 0.6: a learning rate's "lr" is 0.67 from "lora".
    return key in fields or bool(difflib.get_close_matches(str(key), fields, n=1, cutoff=0.7))


def as_mapping(obj: Any, *, what: str) -> dict[str, Any]:
    """A plain dict from any supported hparams container."""
    if obj is None:
        return {}
    if isinstance(obj, (str, Path)):
        return as_mapping(read_text_section(obj, what=what), what=what)
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:
        DictConfig = None  # noqa: N806 - omegaconf is optional
    # Before the Mapping check: a DictConfig is a Mapping whose values stay
    # ListConfig / DictConfig unless converted.
    if DictConfig is not None and isinstance(obj, DictConfig):
        return OmegaConf.to_container(obj, resolve=True)  # type: ignore[return-value]
    if isinstance(obj, Mapping):
        return dict(obj)
    if isinstance(obj, argparse.Namespace):
        return vars(obj)
    raise ValueError(
        f"{what} must be a dict, an argparse.Namespace, an OmegaConf DictConfig, a YAML file path "
        f"or a JSON object string, got {type(obj).__name__}"
    )


def read_text_section(text_or_path: str | Path, *, what: str) -> Any:
    """A JSON object string, or the contents of a YAML file."""
    if isinstance(text_or_path, str) and text_or_path.lstrip().startswith("{"):
        try:
            return json.loads(text_or_path)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what}: not a valid JSON object: {e}") from e
    path = Path(text_or_path)
    if not path.is_file():
        raise ValueError(f"{what}: no such YAML file: {path}")
    try:
        import yaml
    except ImportError as e:
        raise ValueError(f"{what}: reading {path} needs PyYAML (pip install pyyaml)") from e
    return yaml.safe_load(path.read_text()) or {}
