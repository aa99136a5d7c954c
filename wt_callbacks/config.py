"""``SyncConfig``: the ``weight_sync`` section of a trainer's hyperparameters.

One dataclass, parsed from whatever container the training framework keeps
its hyperparameters in (dict, ``argparse.Namespace``, Lightning's
``AttributeDict``, OmegaConf ``DictConfig``), and validated once, when it is
built: a typo in the YAML fails at fit start with a message that names the key
and the fix, never hours later at the first sync round.

Decisions a user can rely on:

* Cadence: at most one of ``every_n_train_steps``, ``every_n_epochs``,
  ``train_time_interval``. When none is given the cadence is
  ``every_n_train_steps=1``: on-policy RL, the main use, wants the servers on
  the newest weights after every optimizer step (TRL and verl default to it).
  ``every_n_train_steps: 0`` (or ``every_n_epochs: 0``) turns periodic
  syncs off, as in ``ModelCheckpoint``: then only the syncs at fit start and
  train end and the adapter's ``sync_now`` run.
* ``include`` / ``exclude`` are shell-style ``fnmatch`` patterns matched
  against the *sent* (checkpoint) names, case-sensitively: YAML-friendly
  (``"*.bias"``, ``"lm_head.*"``; ``*`` also matches dots) with nothing to
  escape. A name is sent when it matches some ``include`` pattern (or
  ``include`` is empty) and no ``exclude`` pattern.
* ``dtype`` and ``timeout_s`` are general settings that also exist in the
  backend's own ``config``; a value set in ``config`` wins, the top-level one
  fills it in when ``config`` leaves it unset. ``timeout_s`` also bounds every
  server call.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from wt_callbacks.hparams import as_mapping, field_or_near_miss
from wt_callbacks.transfer.base import dtype_name, parse_dataclass
from wt_callbacks.transfer.clients import PAUSE_MODES as SERVER_PAUSE_MODES
from wt_callbacks.transfer.factory import WeightTransferTrainerFactory
from wt_callbacks.transfer.validation import check_niceness, check_positive, check_server_urls, parse_wire_dtype

TRIGGER_KEYS = ("every_n_train_steps", "every_n_epochs", "train_time_interval")
EXCLUSIVE_GROUPS = (TRIGGER_KEYS, ("servers", "ray_actors"))
"""Keys of which one is given; an override of one replaces the section's choice."""
PAUSE_MODES = (*SERVER_PAUSE_MODES, "none")
COMMIT_MODES = ("inline", "staged", "prepared")
SEND_MODES = ("blocking", "async")
ASYNC_OVERFLOW_MODES = ("wait", "skip")
ON_ERROR_MODES = ("raise", "warn")
LORA_MODES = ("merge", "adapter")
SEND_FROZEN_MODES = ("once", "every_round")
BACKGROUND_BACKENDS = ("torch_dist",)
"""Backends that can stage a round, send it from a background thread (their
transfer never uses a communicator the training itself may use) and leave
out tensors the servers keep (``send_frozen``): this project's own."""
BACKGROUND_STAGING_NICE = 10
"""``staging_nice`` of a round the training loop does not wait for: the p99
latency of requests beside a round within 1.3x of the rest on a saturated
server (1.12-1.21 measured in three runs; 1.71-1.89 at 0, side by side)."""


def _choices_error(key: str, value: Any, choices: tuple[str, ...]) -> ValueError:
    hint = difflib.get_close_matches(str(value), choices, n=1)
    return ValueError(
        f"{key}={value!r} is not one of {choices}" + (f"; did you mean {hint[0]!r}?" if hint else "")
    )


def _check_str_list(key: str, value: list[str]) -> None:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{key} must be a list of strings, got {type(value).__name__} {value!r}")
    bad = [v for v in value if not isinstance(v, str) or not v]
    if bad:
        raise ValueError(f"{key} must be a list of non-empty strings, got entries {bad!r}")


@dataclass
class SyncConfig:
    """How and when a trainer pushes its weights to inference servers.

    Attributes:
        backend: registered trainer engine (``WeightTransferTrainerFactory.available()``).
        every_n_train_steps: sync after every N optimizer steps; ``0``: no periodic syncs.
        every_n_epochs: sync after every N training epochs; ``0``: no periodic syncs.
        train_time_interval: sync when this much time passed since the last
            round, in seconds (a ``datetime.timedelta`` is accepted and stored
            as seconds). Checked once per optimizer step.
        sync_on_fit_start: cold sync when fitting starts, also after a resume
            (the servers may hold anything).
        sync_on_train_end: final sync when training ends, unless the last
            round already sent that step.
        servers: vLLM server base URLs (``http://host:port``), driven as one unit.
        ray_actors: names of vLLM ``LLM``/``AsyncLLM`` Ray actors, instead of ``servers``.
        ray_namespace: Ray namespace of ``ray_actors``.
        module: attribute path of the submodule to send, in checkpoint naming
            (wrapper segments such as ``module.`` / ``_orig_mod.`` left out);
            ``None`` sends the whole module.
        include: ``fnmatch`` patterns of sent names to keep (empty: all).
        exclude: ``fnmatch`` patterns of sent names to drop.
        dtype: wire dtype name for floating-point parameters (``"bfloat16"``);
            ``None`` sends each parameter's own dtype.
        pause: how servers pause generation during a round (``/pause?mode=``),
            ``"none"`` to not pause.
        commit: ``"inline"``: the servers pause (``pause``) before the first
            byte and apply the round as it arrives; ``"staged"``: they receive
            the whole round into staging while they keep generating on the
            old weights, and pause only for the commit at finish (a staging
            that fails never touches the served model); ``"prepared"``: as
            staged, and vLLM servers also run their loaders and post-load
            processing (the CPU kernels' repack) into a second copy of the
            layers the round loads before the pause, so the commit only
            copies it in (costs that copy's memory on each server; a round
            loading a layer it cannot prepare, such as fused MoE or
            quantized ones, is staged instead, and the server logs why).
            ``torch_dist`` only.
        send: ``"blocking"``: every trainer rank waits for the whole round;
            ``"async"``: the ranks wait only while the sent tensors are
            copied into a host snapshot (the gathers run in lockstep as
            always), and trainer rank 0 runs the round from it on a
            background thread. Its outcome is collected at the next point
            where all ranks meet (the next due round, ``sync_now``, train
            end), where ``on_error`` applies to it. Costs one host copy of
            the sent tensors in the wire dtype, on rank 0. ``torch_dist``
            only, not over ``transport: nccl``.
        staging_nice: the niceness (0-19) the servers receive and prepare a
            ``commit: staged``/``prepared`` round at, so the generation they
            run beside it gets their cores first: requests in flight slow
            down less, and the round takes longer when the servers are busy
            (measured at 10 on a saturated 2-core server: p99 latency of the
            requests beside a round 1.12-1.21x that of the rest instead of
            1.71-1.89x, rounds 3.1-3.6x as long). ``None``: 10 for the rounds ``send: async``
            runs while training goes on, 0 for those the training loop waits
            for (every round under ``send: blocking``; the cold sync, the
            final sync and ``sync_now(verify=True)`` under ``async``). A
            server's ``WT_STAGING_NICE`` is its floor.
        async_overflow: what a round that comes due while the previous one
            is still in flight does (``send: async``): ``"wait"`` for it (the
            wait counts as stall), or ``"skip"`` this round (counted in
            ``weight_sync/skipped``).
        init_info: backend rendezvous settings (``master_address``,
            ``master_port``, optional ``world_size``); ``rank`` is set per
            process. Left out, each takes its backend's default (for
            ``torch_dist``: the address this host reaches the servers from,
            any free port, the servers' own world size).
        config: backend settings (for ``torch_dist``: ``packed``,
            ``packed_buffer_size_bytes``, ``packed_num_buffers``, ``dtype``,
            ``timeout_s``, ``transport``).
        timeout_s: bound in seconds on every server call and transfer wait.
        on_error: ``"raise"`` stops training on a failed round; ``"warn"`` logs,
            keeps training and reconnects at the next due round.
        api_key: the servers' token (their ``VLLM_API_KEY``): the bearer
            token of every call, and what the worker engine checks before it
            joins a transfer group (default: the ``VLLM_API_KEY`` environment
            variable).
        verify_every_n_syncs: after every K-th round, check what the servers
            serve: greedy logprobs of fixed probe prompts against the
            trainer's own model on the same tokens (``wt_callbacks.verify``);
            ``0`` turns it off. Needs ``servers`` and a causal-LM ``module``.
        verify_tolerance: largest |logprob difference| a check accepts before
            the round fails (per ``on_error``); default by wire dtype
            (``wt_callbacks.verify.DEFAULT_TOLERANCES``).
        lora: what a PEFT (LoRA) model sends (``wt_callbacks.lora``):
            ``"merge"`` (the default for a PEFT model) the base checkpoint's
            tensors with the adapters merged in, for servers that serve the
            base checkpoint; ``"adapter"`` the active adapter alone, which the
            servers load and serve as ``lora_name`` beside the base model.
        lora_name: with ``lora: adapter``, the model name requests give to be
            served the adapter (``"model": lora_name``).
        send_frozen: ``"once"``: tensors made only of parameters that do not
            train (``requires_grad`` false, not a LoRA layer's base) are sent in
            the first round of each connection; later rounds leave them as
            the servers hold them (``wt_callbacks.transfer.sources.frozen``
            says which, and why some frozen ones are still sent).
            ``"every_round"``: every round sends every tensor, for code that
            changes frozen parameters by hand. Default: ``"once"`` for a PEFT
            model under ``lora: merge`` (PEFT freezes the base), else
            ``"every_round"``. ``torch_dist`` only.
    """

    backend: str = "torch_dist"
    every_n_train_steps: int | None = None
    every_n_epochs: int | None = None
    train_time_interval: float | datetime.timedelta | None = None
    sync_on_fit_start: bool = True
    sync_on_train_end: bool = True
    servers: list[str] = field(default_factory=list)
    ray_actors: list[str] = field(default_factory=list)
    ray_namespace: str | None = None
    module: str | None = None
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    dtype: str | torch.dtype | None = None
    pause: str = "keep"
    commit: str = "inline"
    send: str = "blocking"
    async_overflow: str = "wait"
    staging_nice: int | None = None
    init_info: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 300.0
    on_error: str = "raise"
    api_key: str | None = None
    verify_every_n_syncs: int = 0
    verify_tolerance: float | None = None
    lora: str | None = None
    lora_name: str | None = None
    send_frozen: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in TRIGGER_KEYS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(
                f"{' and '.join(given)} are mutually exclusive: keep one of {list(TRIGGER_KEYS)}"
            )
        if isinstance(self.train_time_interval, datetime.timedelta):
            self.train_time_interval = self.train_time_interval.total_seconds()
        for key in given:
            if key == "train_time_interval":
                check_positive(key, self.train_time_interval)
            else:
                check_positive(key, getattr(self, key), integer=True, zero_means="no periodic syncs")
        check_positive("timeout_s", self.timeout_s)
        if self.verify_every_n_syncs != 0:
            check_positive("verify_every_n_syncs", self.verify_every_n_syncs, integer=True)
            if not self.servers:
                raise ValueError(
                    "verify_every_n_syncs: verification asks the servers for completions over HTTP; "
                    "it needs servers: [http://host:port, ...], not ray_actors"
                )
        tolerance = self.verify_tolerance
        if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < math.inf):
            raise ValueError(f"verify_tolerance={tolerance!r} must be a positive number (nats of logprob)")

        available = WeightTransferTrainerFactory.available()
        if self.backend not in available:
            raise _choices_error("backend", self.backend, tuple(available))
        if not self.servers and not self.ray_actors:
            raise ValueError(
                "no servers to sync to: set servers: [http://host:port, ...] (vLLM HTTP servers) "
                "or ray_actors: [name, ...] (vLLM Ray actors)"
            )
        if self.servers and self.ray_actors:
            raise ValueError("servers and ray_actors are mutually exclusive: keep one of them")
        for key in ("servers", "ray_actors", "include", "exclude"):
            _check_str_list(key, getattr(self, key))
        # Checked here, on every rank alike: only rank 0 builds the client,
        # and a rank that raises alone leaves the others waiting.
        check_server_urls("servers", self.servers)

        if isinstance(self.dtype, torch.dtype):
            self.dtype = dtype_name(self.dtype)
        if self.dtype is not None:
            parse_wire_dtype(self.dtype)
        if self.pause not in PAUSE_MODES:
            raise _choices_error("pause", self.pause, PAUSE_MODES)
        if self.on_error not in ON_ERROR_MODES:
            raise _choices_error("on_error", self.on_error, ON_ERROR_MODES)
        for key, choices in (("commit", COMMIT_MODES), ("send", SEND_MODES), ("async_overflow", ASYNC_OVERFLOW_MODES)):
            if getattr(self, key) not in choices:
                raise _choices_error(key, getattr(self, key), choices)
        if "rank" in self.init_info:
            raise ValueError("init_info: remove 'rank'; each trainer process sets its own rank")
        self._check_lora()
        self._check_send_frozen()

        # The backend's own parsers check the nested sections now, so a typo
        # there fails at setup like a typo at the top level.
        self._check_background()
        engine_cls = WeightTransferTrainerFactory.engine_class(self.backend)
        engine_cls.parse_settings(self.backend_config(), self.init_info_for(rank=0))

    def _check_lora(self) -> None:
        if self.lora is not None and self.lora not in LORA_MODES:
            raise _choices_error("lora", self.lora, LORA_MODES)
        if self.lora != "adapter":
            if self.lora_name is not None:
                raise ValueError("lora_name names the adapter lora: adapter serves; set lora: adapter or remove lora_name")
            return
        from wt_callbacks.lora.files import check_component

        if self.lora_name is None:
            raise ValueError("lora: adapter needs lora_name: the model name requests give to be served the adapter")
        check_component("lora_name", self.lora_name)
        if not self.servers:
            raise ValueError(
                "lora: adapter has the servers load each version over HTTP (/v1/load_lora_adapter): it needs "
                "servers: [http://host:port, ...], not ray_actors"
            )
        if self.include or self.exclude:
            raise ValueError("include / exclude select checkpoint tensors; lora: adapter sends the adapter whole: remove them")
        if self.commit != "inline":
            # Each version is loaded under a new name and swapped in by one call, so
            # the servers never serve a half-written adapter: staging would only
            # hold a second copy of it.
            raise ValueError(
                f"commit: {self.commit} stages base weights; lora: adapter swaps in each adapter version whole "
                "already: set commit: inline"
            )

    def _check_send_frozen(self) -> None:
        if self.send_frozen is None or self.send_frozen == "every_round":
            return
        if self.send_frozen not in SEND_FROZEN_MODES:
            raise _choices_error("send_frozen", self.send_frozen, SEND_FROZEN_MODES)
        if self.backend not in BACKGROUND_BACKENDS:
            raise ValueError(
                f"send_frozen: once needs backend: torch_dist, not {self.backend!r}: vLLM's own engines load a "
                "round as a whole model and know no kept tensors; set send_frozen: every_round"
            )
        if self.lora == "adapter":
            raise ValueError("send_frozen: once applies to model weights; lora: adapter sends the adapter alone: remove send_frozen")

    def sends_frozen_once(self, peft_merge: bool) -> bool:
        """Whether rounds leave frozen tensors out (``send_frozen``), for a
        source that is (``peft_merge``) or is not a merged PEFT model."""
        if self.send_frozen is not None:
            return self.send_frozen == "once"
        return peft_merge and self.backend in BACKGROUND_BACKENDS

    def _check_background(self) -> None:
        """``commit: staged`` and ``send: async`` only where they can be honoured."""
        why = {
            "commit": "vLLM's own nccl/ipc engines load what they receive as it arrives, so the servers stop for the whole round",
            "send": "vLLM's own nccl/ipc transfer runs a NCCL communicator, which must not run beside the training's own collectives",
        }
        for key, value, default in (("commit", self.commit, "inline"), ("send", self.send, "blocking")):
            if value != default and self.backend not in BACKGROUND_BACKENDS:
                raise ValueError(f"{key}: {value} needs backend: torch_dist, not {self.backend!r}: {why[key]}; set {key}: {default}")
        if self.staging_nice is not None:
            check_niceness("staging_nice", self.staging_nice)
            if self.commit == "inline":
                raise ValueError(
                    "staging_nice sets the niceness servers stage a round at, and commit: inline rounds are not "
                    "staged: set commit: staged or prepared, or remove staging_nice"
                )
        if self.send != "async":
            if self.async_overflow != "wait":
                raise ValueError(
                    f"async_overflow: {self.async_overflow} applies to send: async, and send is {self.send!r}; "
                    "set send: async or remove async_overflow"
                )
            return
        if self.backend_config().get("transport") == "nccl":
            raise ValueError(
                "send: async cannot use config.transport: nccl: a NCCL broadcast on a background thread "
                "would run beside the training's own NCCL collectives, which NCCL does not allow. The "
                "snapshot lies in host memory: use transport 'auto' (shm to this host's servers, gloo to others)"
            )
        if self.verify_every_n_syncs:
            raise ValueError(
                "verify_every_n_syncs: under send: async a round ends after training moved on, so the "
                "trainer's model no longer holds the weights to compare with; set verify_every_n_syncs: 0 "
                "and call sync_now(verify=True), which waits for its round and verifies it"
            )

    def staging_niceness(self, *, awaited: bool) -> int:
        """The ``staging_nice`` a round asks the servers for (its default
        resolved), for a round the training loop waits for (``awaited``) or not."""
        if self.staging_nice is not None:
            return self.staging_nice
        return 0 if awaited or self.commit == "inline" else BACKGROUND_STAGING_NICE

    @property
    def trigger(self) -> tuple[str, float]:
        """The periodic cadence in effect, ``(key, value)``; ``("every_n_train_steps", 1)``
        when none is configured, a value of ``0`` when periodic syncs are off."""
        for key in TRIGGER_KEYS:
            value = getattr(self, key)
            if value is not None:
                return key, value
        return "every_n_train_steps", 1

    @property
    def pause_mode(self) -> str | None:
        """The ``/pause`` mode, ``None`` when servers are not paused."""
        return None if self.pause == "none" else self.pause

    def backend_config(self) -> dict[str, Any]:
        """The backend ``config`` dict with top-level ``dtype``/``timeout_s``
        filled in where the backend has such a key and ``config`` leaves it unset."""
        engine_cls = WeightTransferTrainerFactory.engine_class(self.backend)
        keys = {f.name for f in dataclasses.fields(engine_cls.config_cls)}
        merged = dict(self.config)
        for key, value in (("dtype", self.dtype), ("timeout_s", self.timeout_s)):
            if key in keys and merged.get(key) is None:
                merged[key] = value
        return merged

    def init_info_for(self, rank: int) -> dict[str, Any]:
        """The backend init_info of trainer ``rank``."""
        return {**self.init_info, "rank": rank}

    @classmethod
    def from_hparams(cls, obj: Any = None, key: str = "weight_sync", **overrides: Any) -> SyncConfig:
        """Parse and validate from a framework's hyperparameters.

        ``obj`` is a dict (Lightning's ``AttributeDict`` is one), an
        ``argparse.Namespace``, an OmegaConf ``DictConfig``, a YAML file path,
        a JSON object string (what a command-line flag gives a ``str``
        field) or ``None``. It is
        either a container holding the section under ``key``, or the section
        itself: without ``key``, ``obj`` counts as the section when every one
        of its keys is a ``SyncConfig`` field or a near miss of one (so typos
        get a did-you-mean), and as hyperparameters without the section when
        none is a field (only ``overrides`` apply); keys of both kinds (a
        training config holding a ``dtype``, or a section with a stray key)
        are refused, naming both, rather than guessed. ``overrides`` (constructor arguments of the
        framework adapter) win over the section; ``None`` means "not given".
        An override of a cadence key (or of ``servers`` / ``ray_actors``)
        replaces the section's cadence (destination) instead of clashing with it.

        Raises:
            ValueError: naming the key to fix (``"{key}: ..."``).
        """
        container = as_mapping(obj, what="hparams")
        fields = {f.name for f in dataclasses.fields(cls)}
        if key in container:
            section = as_mapping(container[key], what=key)
        elif not fields & set(container):
            section = {}
        else:
            others = [k for k in container if not field_or_near_miss(k, fields)]
            if others:
                raise ValueError(
                    f"{key}: these hyperparameters have no {key!r} key, and they mix its keys "
                    f"({sorted(fields & set(container))}) with others ({sorted(map(str, others))}): put the "
                    f"section under {key!r}, or pass the section alone"
                )
            section = container
        given = {k: v for k, v in overrides.items() if v is not None}
        for group in EXCLUSIVE_GROUPS:
            if given.keys() & set(group):
                section = {k: v for k, v in section.items() if k not in group}
        merged = {**section, **given}
        return parse_dataclass(cls, merged, what=key)


def shared_resume_state_error(callback: str, hparams_key: str, module: str | None) -> ValueError:
    """What a framework adapter raises for two of its callbacks whose resume
    states share one key (``hparams_key`` and ``module``, never the servers)."""
    return ValueError(
        f"two {callback}s read hparams_key={hparams_key!r} and send module={module!r}: their resume "
        "states would overwrite each other. Give each its own hparams_key (one weight_sync section per "
        "server group)"
    )
