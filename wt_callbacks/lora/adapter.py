"""``lora: adapter`` on the trainer side: the adapter's tensors, and a client that has servers load them.

Only the active adapter crosses the wire (``A`` and ``B`` of each targeted
module, as PEFT saves them): 17.6 MB in bf16 for a 0.5B model at r=16 on
every linear layer, against about 1 GB for the model. The servers keep
serving their base checkpoint and serve the adapter to requests naming
``lora_name``.

A round is an ordinary weight update whose ``update_info`` says it holds an
adapter (``"lora": {name, version, config}``); the server side writes it as
one version on its own disk (``files``), and after ``finish_weight_update``
the trainer asks each server to load it (``POST /v1/load_lora_adapter`` with a
``wt-lora://`` reference the server resolves). The vLLM plugin gives every
version its own adapter id and path, so no request is served a stale
version, and keeps a version's files while any request may still read them
(``integrations/vllm_lora.py``).

Before the rendezvous the servers are asked whether they can serve it
(``GET /server_info``, ``AdapterServingClient.check_servers``): a server started without ``--enable-lora``, without
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, with ``--max-lora-rank`` below the
adapter's rank, or one that cannot apply LoRA to the model (MoE experts on
vLLM's CPU backend) is refused there, naming the flag or ``lora: merge``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from wt_callbacks.lora import files, saved
from wt_callbacks.lora.layout import LoraLayout
from wt_callbacks.naming import checkpoint_name, find_submodule
from wt_callbacks.transfer.base import WeightTransferError, finish_with_version
from wt_callbacks.transfer.sources.gathering import ParameterGather
from wt_callbacks.transfer.sources.schemes import gather_for, sharding_scheme
from wt_callbacks.transfer.weight_source import Metadata, ParamMeta, WeightSource

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 takes for ``--max-lora-rank``."""


@dataclass(frozen=True)
class _Plan:
    key: tuple[Any, ...]
    layout: LoraLayout
    gather: ParameterGather
    raw: tuple[str, ...]
    """The adapter's tensors as the gatherer holds them, in stream order."""
    metas: tuple[ParamMeta, ...]
    """The same, as PEFT saves them (their own dtypes)."""


class AdapterSource(WeightSource):
    """The active LoRA adapter of a PEFT model, as PEFT saves it.

    Yields ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``
    (``lora_embedding_A`` / ``_B`` for embeddings), and the trained copies of
    ``modules_to_save`` vLLM serves, gathered like any parameter under every
    sharding scheme (``gathering``). The plan follows the module: sharded
    after the source was built (``fully_shard`` in ``configure_model``), or
    another adapter made active.

    Args:
        module: the module as the training framework holds it.
        dtype: wire dtype (``None``: the adapter's own).
        submodule: path of the PEFT model (or of the module holding it), as ``module:`` gives it.

    Raises:
        ValueError: at construction, naming the fix: no PEFT model, several
            active adapters, or what vLLM does not serve as an adapter (DoRA,
            ``lora_bias``, trained base biases, inits that change the base
            weights, fan-in-fan-out layers, ``modules_to_save`` other than a
            classifier), each naming ``lora: merge``.
    """

    def __init__(self, module: torch.nn.Module, *, dtype: torch.dtype | None = None, submodule: str | None = None) -> None:
        self._module = module
        self._dtype = dtype
        self._submodule = submodule
        self._root = find_submodule(module, submodule)
        if LoraLayout.of(self._root) is None:
            raise ValueError(
                f"lora: adapter: module={submodule!r} ({type(self._root).__name__}) holds no PEFT model; wrap the "
                "model with peft.get_peft_model (or give module: the path of the PEFT model)"
            )
        self._cache: _Plan | None = None
        self._plan()

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    @property
    def layout(self) -> LoraLayout:
        return self._plan().layout

    def _plan(self) -> _Plan:
        scheme = sharding_scheme(self._module, self._root)
        cached = self._cache
        if cached is not None and cached.key == (scheme, cached.layout.state()):
            return cached
        layout = LoraLayout.of(self._root)
        assert layout is not None
        gather = cached.gather if cached is not None and cached.key[0] == scheme else gather_for(self._module, self._submodule)
        held = {checkpoint_name(m.name): m for m in gather.parameters()}
        pairs = saved.adapter_tensors(layout, list(held))
        raw = tuple(held[name].name for name, _ in pairs)
        metas = tuple(ParamMeta(sent, held[name].dtype, held[name].shape) for name, sent in pairs)
        self._cache = _Plan((scheme, layout.state()), layout, gather, raw, metas)
        return self._cache

    def with_wire_dtype(self, dtype: torch.dtype | None) -> WeightSource:
        if dtype is None or dtype == self._dtype:
            return self
        cast = copy.copy(self)
        cast._dtype = dtype
        return cast

    @property
    def metadata(self) -> Metadata:  # type: ignore[override]
        """The adapter's tensors, every rank owning each (a list that also answers a call, as ``ModuleSource``'s)."""
        wire = self._dtype
        return Metadata(
            ParamMeta(m.name, wire if wire and m.dtype.is_floating_point else m.dtype, m.shape) for m in self._plan().metas
        )

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        plan = self._plan()
        sent = {raw: m.name for raw, m in zip(plan.raw, plan.metas)}
        for raw, tensor in plan.gather.gather(plan.raw, self._dtype):
            yield sent[raw], tensor

    def gather_only(self) -> Iterator[str]:
        plan = self._plan()
        return plan.gather.gather_only(plan.raw, self._dtype)

    def adapter_config(self) -> dict[str, Any]:
        """The ``adapter_config.json`` servers load the adapter with (read live: scaling changes are taken)."""
        return saved.adapter_config(self.layout)


def smallest_rank_flag(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM takes that covers ``rank``."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)


class AdapterServingClient:
    """Wraps the trainer's HTTP client so every round's adapter is served as ``lora_name``.

    The transfer engine drives it as any client; on top, ``update_weights``
    marks the update as the adapter's next version, and ``finish_weight_update``,
    after the servers finished the update, has each of them load that version
    (``/v1/load_lora_adapter``). Every other call goes to the wrapped client.

    Args:
        client: the ``HTTPVLLMWeightSyncClient`` of the servers.
        lora_name: the model name requests give to be served the adapter.
        source: the ``AdapterSource`` whose adapter is sent.
        moe: the base model has MoE experts (which vLLM's CPU backend cannot serve LoRA on).
    """

    def __init__(self, client: Any, lora_name: str, source: AdapterSource, *, moe: bool = False) -> None:
        self._client = client
        self.lora_name = files.check_component("lora_name", lora_name)
        self._source = source
        self._moe = moe
        self._tags: list[str] = []
        self._version = 0
        self._received: int | None = None  # the version every server received, not loaded yet

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    # -- VLLMWeightSyncClient ----------------------------------------------

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        offsets = [p.get("rank_offset", 1) for p in self._client.init_payloads(init_info)]
        self._client.init_weight_transfer_engine(init_info)
        # Set once the servers joined: a failed init keeps the live session's.
        self._tags = [files.session_tag(init_info.get("session_id"), offset) for offset in offsets]
        self._version, self._received = 0, None

    def start_weight_update(self) -> None:
        self._client.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self._version += 1
        self._received = None
        lora = {"name": self.lora_name, "version": str(self._version), "config": self._source.adapter_config()}
        if isinstance(update_info, list):
            update_info = [{**info, "lora": lora} for info in update_info]
        else:
            update_info = {**update_info, "lora": lora}
        self._client.update_weights(update_info)
        self._received = self._version

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish the update; then, if every server received this round's
        version (not after a failed round: the clean-up finish), load it."""
        finish_with_version(self._client, weight_version)
        version, self._received = self._received, None
        if version is None:
            return
        refs = [files.reference(tag, self.lora_name, str(version)) for tag in self._tags]
        try:
            self._client.load_lora_adapter(self.lora_name, refs)
        except WeightTransferError as e:
            raise WeightTransferError(
                f"lora: adapter: loading version {version} as {self.lora_name!r} failed; the servers keep "
                f"serving the previous version. {e}"
            ) from e

    # -- the servers' LoRA support ------------------------------------------

    def check_servers(self) -> None:
        """Refuse a server that cannot serve this adapter; call before the rendezvous.

        Raises:
            WeightTransferError: naming the server flag to add, or ``lora: merge``.
        """
        rank = saved.max_rank(self._source.layout)
        for url, info in zip(self._client.base_urls, self._client.server_info()):
            if info is None:
                continue  # a server without vLLM's /server_info: its load answers for it
            problem = adapter_refusal(info, rank, moe=self._moe)
            if problem:
                raise WeightTransferError(f"lora: adapter: {url} {problem}")


def adapter_refusal(info: dict[str, Any], rank: int, *, moe: bool) -> str | None:
    """Why a server whose ``/server_info`` (JSON) is ``info`` cannot serve an
    adapter of ``rank``, or ``None``."""
    config = info.get("vllm_config") or {}
    env = info.get("vllm_env") or {}
    lora = config.get("lora_config") if isinstance(config, dict) else None
    if not lora:
        return "was started without LoRA support: add --enable-lora (and --max-lora-rank >= the adapter's rank)"
    if not env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        return "does not load adapters at run time: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
    max_rank = int(lora.get("max_lora_rank") or 0)
    if rank > max_rank:
        return (
            f"serves LoRA ranks up to {max_rank} and the adapter has rank {rank}: start it with "
            f"--max-lora-rank {smallest_rank_flag(rank)}"
        )
    device = str((config.get("device_config") or {}).get("device_type") or (config.get("device_config") or {}).get("device") or "")
    if moe and device == "cpu":
        return (
            "runs on vLLM's CPU backend, which cannot apply LoRA to MoE experts (with --enable-lora its engine "
            "dies on the first request): use lora: merge"
        )
    return None

