"""Dtype names on the wire: a dtype travels as its torch attribute name (``"bfloat16"``), as in vLLM's update infos."""

from __future__ import annotations

import difflib

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype: its torch attribute name (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, *, key: str = "dtype") -> torch.dtype:
    """Decode a wire dtype name; ``ValueError`` naming ``key`` if it is not one."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        known = sorted(n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype))
        hint = difflib.get_close_matches(str(name), known, n=1)
        raise ValueError(
            f"{key}={name!r} is not a torch dtype name"
            + (f"; did you mean {hint[0]!r}?" if hint else f"; use one of {known}")
        )
    return value
