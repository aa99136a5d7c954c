"""Checks of values that several configs take, each with one error message.

The trainer's ``SyncConfig``, the backends' configs and init dicts, and the
HTTP client all accept some of the same kinds of value; checking each kind
here keeps the rule and the message that names the key to fix the same
wherever the value is given. ``checked_stream`` holds a weight source's
tensors to its metadata, for the engines and the host snapshot that read it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from wt_callbacks.transfer.dtypes import dtype_from_name, dtype_name
from wt_callbacks.transfer.weight_source import ParamMeta


MAX_SECONDS = 1e9
"""About 31 years: "no limit" in practice, and far below what the clocks
behind a wait take (a TCPStore deadline of 1e15 s is out of time_t's range
and fails the rendezvous with an error that names no key)."""


def check_positive(key: str, value: Any, *, integer: bool = False, zero_means: str | None = None) -> None:
    """``value`` must be a finite number > 0 (an ``int`` if ``integer``;
    otherwise seconds, at most ``MAX_SECONDS``), or ``0`` when ``zero_means``
    says what a ``0`` does (it goes into the message). NaN fails too: every
    comparison with it is false, so a NaN timeout or interval would never fire."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        ok = False
    else:
        ok = 0 < value <= (math.inf if integer else MAX_SECONDS) and value != math.inf
        ok = ok or (zero_means is not None and value == 0)
    if not ok:
        raise ValueError(
            f"{key}={value!r} must be a positive " + ("integer" if integer else f"number of seconds (<= {MAX_SECONDS:g})")
            + (f", or 0 for {zero_means}" if zero_means else "")
        )


def check_niceness(key: str, value: Any, *, shown: Any = None) -> None:
    """Refuse (``ValueError`` naming ``key`` and ``shown``, default
    ``value``) a niceness other than an int from 0 to 19: a process may
    raise its threads' niceness, not lower it."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 19:
        raise ValueError(f"{key}={value if shown is None else shown!r} must be an integer niceness from 0 to 19")


def check_wire_fields(info: Any) -> None:
    """The packing fields of vLLM's trainer init infos, on any config or init
    info that has them: ``packed`` a bool, the buffer size and count positive
    integers. ``None`` (a config leaving the value to the init info) passes."""
    packed = getattr(info, "packed", None)
    if packed is not None and not isinstance(packed, bool):
        raise ValueError(f"packed={packed!r} must be True or False")
    for key in ("packed_buffer_size_bytes", "packed_num_buffers"):
        value = getattr(info, key, None)
        if value is not None:
            check_positive(key, value, integer=True)


def parse_wire_dtype(name: str, *, key: str = "dtype") -> torch.dtype:
    """The floating-point dtype named ``name``, the only kind a wire dtype may be
    (integer parameters always travel in their own dtype)."""
    dtype = dtype_from_name(name, key=key)
    if not dtype.is_floating_point:
        raise ValueError(f"{key}={name!r}: the wire dtype must be a floating-point dtype such as 'bfloat16'")
    return dtype


def check_server_urls(key: str, urls: Sequence[Any]) -> None:
    """Every entry is an ``http(s)://`` base URL, none listed twice."""
    for url in urls:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{key}: {url!r} is not an http(s) URL such as 'http://127.0.0.1:8000'")
    # Compared as the clients call them, without trailing slashes: a server
    # listed twice would join its group twice and the round would time out.
    bases = [url.rstrip("/") for url in urls]
    if len(set(bases)) != len(bases):
        raise ValueError(f"{key}: the same server is listed twice: {list(urls)}")


def checked_stream(items: Iterator[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> Iterator[torch.Tensor]:
    """Yield tensors, raising on the first disagreement with ``metadata()``.

    The receivers sized their buffers and chunk cuts from the metadata; a
    tensor that differs would corrupt every tensor after it. A floating-point
    tensor may come in another floating-point dtype than its metadata's
    (``WeightSource.iter_uncast``): the sending converts it.
    """
    i = -1
    for i, (name, tensor) in enumerate(items):
        if i >= len(metas):
            raise ValueError(
                f"the weight source yielded more tensors than metadata() lists ({len(metas)}); "
                f"first extra: {name!r}"
            )
        m = metas[i]
        dtype_ok = tensor.dtype == m.dtype or (tensor.is_floating_point() and m.dtype.is_floating_point)
        if name != m.name or not dtype_ok or tuple(tensor.shape) != m.shape:
            raise ValueError(
                f"the weight source disagrees with its metadata() at index {i}: metadata says "
                f"{m.name!r} {dtype_name(m.dtype)} {list(m.shape)}, iteration yielded "
                f"{name!r} {dtype_name(tensor.dtype)} {list(tensor.shape)}"
            )
        yield tensor
    if i + 1 != len(metas):
        raise ValueError(
            f"the weight source yielded {i + 1} tensors but metadata() lists {len(metas)}; "
            f"first missing: {metas[i + 1].name!r}"
        )
