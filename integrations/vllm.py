"""vLLM plugin: makes ``--weight-transfer-config '{"backend": "torch_dist"}'`` work.

vLLM 0.32 has no CPU-capable weight-transfer backend (its ``nccl`` needs CUDA),
and it builds the worker engine by name from its own
``WeightTransferEngineFactory`` when the model is loaded. Installing
wt-callbacks into the server's environment declares the entry point::

    [project.entry-points."vllm.general_plugins"]
    wt_callbacks = "wt_callbacks.integrations.vllm:register"

and vLLM calls ``register()`` in every process it starts (API server, engine
core, each worker) before any engine is built. ``register()`` adds our
``torch_dist`` worker engine to vLLM's factory by module path, so only the
worker that actually creates the engine imports it.

Nothing here is imported by the trainer: the trainer side is
``wt_callbacks.transfer`` and needs no vLLM. The CPU performance adjustments
the plugin makes in vLLM's processes are in ``vllm_cpu_tuning``; what makes
rounds through vLLM's layerwise reload exact and complete is in
``vllm_reload`` (with ``vllm_layerwise``, ``vllm_load_trace`` and
``vllm_reload_state``). What keeps the workers of a TP/PP engine in step
is in ``vllm_collective_rpc``, and what ``/weight_checker`` adds to prove
their weights in ``vllm_served_checksums``. LoRA adapter rounds (``lora:
adapter``) skip the reload and are written as versions vLLM loads
(``vllm_lora``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from wt_callbacks.integrations import vllm_collective_rpc, vllm_cpu_tuning, vllm_lora, vllm_served_checksums

if TYPE_CHECKING:
    from wt_callbacks.transfer.backends.torch_dist import (
        TorchDistWeightTransferEngine,
        TorchDistWeightTransferUpdateInfo,
    )

# Under vLLM's logger, whose handler vLLM sets up in every process it starts.
logger = logging.getLogger(f"vllm.{__name__}")

BACKEND = "torch_dist"
ENGINE_CLASS_NAME = "VLLMTorchDistWeightTransferEngine"


def register() -> None:
    """Register the ``torch_dist`` worker engine with vLLM (entry point target).

    Idempotent: vLLM runs general plugins once per process, but a process may
    also call this by hand, and vLLM's factory raises on a duplicate name.
    Cheap: it imports vLLM's factory only; the engine class is resolved
    lazily by the worker that builds it. In the engine core it makes a
    call on the workers read every worker's reply before it fails
    (``vllm_collective_rpc``), and ``update_weights`` calls wait without
    spinning; in a worker it finds the RPC queue whose spin an update
    session quiets (``vllm_cpu_tuning``); in the API server it has LoRA
    adapter versions load under an id each (``vllm_lora``).
    """
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, ENGINE_CLASS_NAME)
    # Innermost: the polling reads the executor's real reply queues.
    vllm_collective_rpc.read_every_reply()
    vllm_cpu_tuning.poll_during_updates(BACKEND)
    vllm_cpu_tuning.find_worker_queue()
    vllm_lora.serve_adapter_versions()


def __getattr__(name: str) -> Any:
    """Resolve the engine class on first access (PEP 562).

    vLLM's lazy loader does ``getattr(import_module(__name__), class_name)``;
    deferring the class keeps importing this module (which every vLLM
    process does, for ``register``) free of torch.distributed and our backend.
    """
    if name == ENGINE_CLASS_NAME:
        return _engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _engine_class() -> type[TorchDistWeightTransferEngine]:
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    from wt_callbacks.integrations.vllm_layerwise import failed_load_warnings_quieted, processing_deferred
    from wt_callbacks.integrations.vllm_prepared import PreparedRound, unprepared_reason
    from wt_callbacks.integrations.vllm_reload import ReloadGuard
    from wt_callbacks.transfer.backends.torch_dist import TorchDistWeightTransferEngine
    from wt_callbacks.transfer.backends.torch_dist.staging import StagedTensors

    class VLLMTorchDistWeightTransferEngine(TorchDistWeightTransferEngine):
        """``TorchDistWeightTransferEngine`` inside a vLLM worker.

        Adds what vLLM's own ``nccl`` engine does around the transfer:
        layerwise reload, so checkpoint-format tensors go through the model's
        ``load_weights`` (fused qkv/gate_up, TP sharding) and its
        post-load processing (CPU kernels repack Linear weights), and what
        that reload needs to be exact and complete (``ReloadGuard``: tied
        parameters, CPU MoE kernels, a round refused before streaming when
        it would leave a checkpoint tensor out, and a finish that fails,
        naming the served parameter, when a layer was not updated).
        Receiving and loading are the base engine's.

        An update is all or nothing: layers are processed (their new weights
        written into the served tensors) only once all of its tensors have
        arrived (``processing_deferred``), unless the trainer's
        ``all_or_nothing`` is off: then each layer is processed as it
        completes, as vLLM's own engines do. A failed ``update_weights`` puts
        the old tensors back into every layer it had not processed (every
        layer when all or nothing, unless vLLM's processing itself failed
        part way), so the server keeps generating, on its previous weights
        (and, all or nothing off, the new ones of the layers it processed),
        instead of running on the meta tensors layerwise reload leaves
        behind: vLLM ends the update on any exception
        (``_weight_update_active=False``) without finalizing, so a later
        finish would not restore them, and the next start would save meta
        tensors as the "old" ones. That holds for an update refused
        before anything was received too (a malformed or foreign
        update_info, a mismatched model): it ends vLLM's update but not our
        transfer session, so the trainer's next round works.

        A staged update (the trainer's ``commit: staged``) is checked as any
        other before any byte moves (the check runs the model's loaders with
        layerwise reload initialized and undone inside the RPC), then
        received on a thread into ``StagedTensors`` while vLLM keeps
        generating: the served model is not touched until
        ``finish_weight_update``, which waits for the staging and then does
        what an update does (layerwise reload, the model's ``load_weights``,
        every layer processed once all of it is loaded, the checks at
        finish). A staging that failed, or whose trainer left the group
        before this finish, is discarded and the finish raises. A prepared
        update (``commit: prepared``) is staged into shadows of the layers it
        loads and processed there while vLLM serves (``vllm_prepared``): its
        finish only copies them in. A round with a layer that cannot be
        prepared is staged as above, and the worker logs why.
        """

        def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
            super().__init__(config, vllm_config, device, model)
            vllm_collective_rpc.require_rpc_internals(self.parallel_config.world_size)
            vllm_served_checksums.include_cpu_kernels()
            self._heap = vllm_cpu_tuning.keep_freed_host_memory(device)
            self._guard = ReloadGuard(model, device, str(self.model_config.model))
            self._reload_begun = False
            self._polls = vllm_cpu_tuning.WorkerPolls()
            self._applied_s = 0.0
            self._staged: StagedTensors | PreparedRound | None = None
            self._inline_session = False  # the session's last update was inline (see start_weight_update)
            self._unprepared: set[str] = set()  # why prepared rounds were staged, said once at WARNING

        def start_weight_update(self) -> None:
            super().start_weight_update()
            # Layerwise reload turns every layer into meta tensors until its
            # weights arrive. Begun here, a round whose update never arrives
            # (its trainer killed, or the call lost while the server was
            # frozen) would leave a server that crashes on its next request;
            # it begins with the round's first update instead.
            self._reload_begun = False
            # The worker waits for the next call without spinning only in a
            # session whose rounds are inline (the trainer pauses the server
            # for them): while the engine steps, as it does around a staged
            # round, a polling worker was woken up to 5 s late (vLLM's
            # recheck interval) for the steps' calls. A session's first
            # round does not tell yet: it spins, as vLLM does.
            if self._inline_session:
                self._polls.enter()

        def init_transfer_engine(self, init_info: Any) -> None:
            super().init_transfer_engine(init_info)
            self._inline_session = False  # a new trainer: its rounds may be of either kind

        def _begin_reload(self) -> None:
            if not self._reload_begun:
                initialize_layerwise_reload(self.model)
                self._guard.start()
                self._reload_begun = True

        def finish_weight_update(self) -> None:
            try:
                self._finish()
            finally:
                received = self.last_receive
                if self._heap is not None and received is not None:
                    self._heap.after_round(received.bytes, trim=received.mapped)

        def _finish(self) -> None:
            self._polls.exit()
            staged, self._staged = self._staged, None
            if staged is not None:
                self.finish_staging()  # raises with the served model untouched
                if isinstance(staged, PreparedRound):
                    self._commit_prepared(staged)
                else:
                    self._commit(staged)
            if not self._guard.round_open:
                # No update arrived (the weights were never touched), or the
                # clean-up finish a trainer sends after a failed round: vLLM
                # keeps a session whose finish raised marked active.
                return
            incomplete, processed = self._guard.keep_incomplete()
            # vLLM would warn for each layer without checkpoint tensors (a
            # rotary embedding's cache) every round; a layer the round left
            # incomplete fails it below, naming the parameter.
            with failed_load_warnings_quieted() as put_back:
                finalize_layerwise_reload(self.model, self.model_config)
            if put_back:
                logger.debug("wt_callbacks finish_weight_update: layers no tensor loaded: %s", ", ".join(put_back))
            self._guard.end(processed)
            if incomplete:
                more = f" (and {len(incomplete) - 1} more layers)" if len(incomplete) > 1 else ""
                raise RuntimeError(
                    f"{incomplete[0].message()}{more}. Those layers keep the previous weights; layers this "
                    "round completed hold the new ones. Push every tensor of the checkpoint again"
                )

        def update_weights(self, update_info: Any) -> None:
            # Parsed once: the base engines take the typed info as it is.
            typed = self.parse_update_info(update_info)
            if typed.lora is not None:
                # A LoRA adapter (``lora: adapter``): the base engine writes it
                # as a version on this host's disk; the model is not touched
                # (no layerwise reload, nothing to stage), and vllm_lora loads
                # it when asked.
                super().update_weights(typed)
                return
            if typed.staged:
                self._inline_session = False
                self._polls.exit()  # the engine steps while the round stages: vLLM's own waiting
                # The target is chosen once the round is accepted: a prepared one needs its trace.
                self._staged = self.stage_weights(
                    typed, into=self._prepared_round if typed.prepared else StagedTensors
                )
                return
            self._inline_session = True
            with self._restored_on_failure("round"):
                self._begin_reload()
                super().update_weights(typed)
            received = self.last_receive
            if received is None:
                return
            # The worker's side of where a round's time goes, which a trainer
            # cannot see: receiving (and waiting for data) vs vLLM's own
            # processing of the layers, which waits for the whole update.
            logger.info(
                "wt_callbacks update_weights: %d tensors, %.1f MB received in %.3f s "
                "(%.3f s of it waiting for the trainer's data), applied in %.3f s",
                received.tensors, received.bytes / 1e6, received.seconds, received.waiting_s, self._applied_s,
            )  # fmt: skip

        def log_receiving(self, update_info: TorchDistWeightTransferUpdateInfo) -> None:
            # Under vLLM's logger: the base engine's has no handler here.
            if update_info.lora is not None:
                logger.info(
                    "wt_callbacks update_weights: receiving %d tensors of LoRA adapter %r, version %s",
                    len(update_info.names), update_info.lora["name"], update_info.lora["version"],
                )  # fmt: skip
                return
            if update_info.staged:
                logger.info(
                    "wt_callbacks update_weights: staging %d tensors while the server generates%s, at niceness %d",
                    len(update_info.names), ", processed into shadow layers before the pause" if update_info.prepared else "",
                    self.staging_niceness(update_info),
                )  # fmt: skip
                return
            logger.info(
                "wt_callbacks update_weights: receiving %d tensors, layers applied %s",
                len(update_info.names), "once all arrived" if self.init_info.all_or_nothing else "as each completes",
            )  # fmt: skip

        def check_update(self, update_info: TorchDistWeightTransferUpdateInfo, target: Any) -> None:
            if update_info.lora is not None:  # checked against the adapter, not the served checkpoint
                super().check_update(update_info, target)
                return
            reason = self._guard.refusal(
                update_info.names, update_info.dtypes, update_info.shapes, serving=update_info.staged,
                kept=(update_info.kept_names, update_info.kept_dtypes, update_info.kept_shapes),
            )  # fmt: skip
            if reason is not None:
                raise ValueError(
                    f"{reason}. Nothing was received; the server keeps the previous weights. The trainer "
                    f"must send every tensor of the checkpoint this server loaded ({self.model_config.model}) "
                    "under its checkpoint name and shape"
                )

        def receive_weights(self, update_info: TorchDistWeightTransferUpdateInfo) -> None:
            if update_info.lora is not None:
                super().receive_weights(update_info)
                return
            with self._loading():
                super().receive_weights(update_info)

        def _commit(self, staged: StagedTensors) -> None:
            """Load a staged round into the served model, as an update loads
            what it receives; a failure puts the previous weights back."""
            started, count = time.perf_counter(), len(staged.tensors)
            with self._restored_on_failure("commit"):
                self._begin_reload()
                with self._loading() as tracker:
                    tracker.load_weights(staged.drain())
            received = self.last_receive
            logger.info(
                "wt_callbacks finish_weight_update: %d staged tensors, %.1f MB received in %.3f s while the "
                "server generated; committed in %.3f s (%.3f s of it vLLM's processing)",
                count, (received.bytes if received else 0) / 1e6, received.seconds if received else 0.0,
                time.perf_counter() - started, self._applied_s,
            )  # fmt: skip

        def _prepared_round(self) -> StagedTensors | PreparedRound:
            """Where an accepted ``commit: prepared`` round stages: shadows of
            the layers its trace loads, or, when one of them (or a layer tied
            to one) cannot be prepared, plain staging."""
            names = self._guard.loaded_layers
            reason = None if names is not None else (
                "its load could not be traced for sure (the served checkpoint is not local safetensors, or a "
                "loader reads values)"
            )  # fmt: skip
            modules = dict(self.model.named_modules())
            layers = {name: modules[name] for name in sorted(names or ()) if name in modules}
            tied = [m for m in self._guard.tied.groups if any(name in layers for name, _, _ in m)]
            reason = reason or unprepared_reason(self.model, layers, tied)
            if reason is not None:
                # Once per reason at WARNING: every round of such a model says the same.
                level = logging.INFO if reason in self._unprepared else logging.WARNING
                self._unprepared.add(reason)
                logger.log(level, "wt_callbacks update_weights: this round is staged, not prepared: %s", reason)
                return StagedTensors()
            assert self._guard.coverage is not None  # loaded_layers are known only against one
            return PreparedRound(self.model, layers, tied, self._guard.coverage.counts)

        def _commit_prepared(self, prepared: PreparedRound) -> None:
            """Copy a prepared round into the served model; a shadow that does
            not fit raises before anything is copied."""
            started = time.perf_counter()
            copied = prepared.commit()
            received = self.last_receive
            logger.info(
                "wt_callbacks finish_weight_update: %d prepared tensors, %.1f MB received, loaded and processed "
                "in %.3f s while the server generated; committed in %.3f s (%.1f MB copied)",
                prepared.tensors, (received.bytes if received else 0) / 1e6, received.seconds if received else 0.0,
                time.perf_counter() - started, copied / 1e6,
            )  # fmt: skip

        @contextlib.contextmanager
        def _restored_on_failure(self, what: str) -> Any:
            """The previous weights put back if the body fails; the body's error is what the call raises."""
            try:
                yield
            except Exception:
                try:
                    self._abandon_reload()
                except Exception:  # noqa: BLE001 - report the error that ended the round
                    logger.exception("restoring the previous weights after a failed %s failed", what)
                raise

        @contextlib.contextmanager
        def _loading(self) -> Any:
            """Around a load into the served model: the tracker in its place
            (``self.model`` while the body runs, yielded), every layer's
            processing deferred to the body's end unless the trainer's
            ``all_or_nothing`` is off, and a loader's error named."""
            layerwise = self.init_info is not None and not self.init_info.all_or_nothing
            model = self.model
            tracker = _LoadTracker(model)
            # The base engine loads through ``self.model.load_weights``; the
            # tracker lets an error name the tensor vLLM's loader refused
            # (its shape asserts do not).
            self.model = tracker
            try:
                # The chunks of a round received in mapped memory are freed
                # as its layers are processed (a round that copies, or comes
                # unpacked, is not mapped whatever the setting).
                mapped = lambda: self.last_receive is not None and self.last_receive.mapped  # noqa: E731
                deferred = contextlib.nullcontext() if layerwise else processing_deferred(large_last=mapped)
                with disable_mtp_completeness_check(), deferred:
                    yield tracker
                    received = time.perf_counter()
                self._applied_s = time.perf_counter() - received
            except Exception as e:
                if tracker.last is None:
                    raise
                name, dtype, shape = tracker.last
                reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                raise RuntimeError(
                    f"the served model rejected {name!r} ({dtype}, shape {shape}) from the trainer "
                    f"({reason}). The trainer's parameter names and shapes must be those of the "
                    f"checkpoint this server loaded ({self.model_config.model})"
                ) from e
            finally:
                self.model = model

        def _abandon_reload(self) -> None:
            """Undo layerwise reload for the layers this round did not process
            (all of them, unless processing itself failed part way)."""
            self._polls.exit()
            processed = self._guard.processed_layers()
            for layer in self.model.modules():
                info = get_layerwise_info(layer)
                if info.can_load():
                    info.loaded_weights.clear()
                    info.load_numel = 0
            with failed_load_warnings_quieted() as put_back:
                finalize_layerwise_reload(self.model, self.model_config)
            self._guard.abandon(processed)
            logger.warning(
                "wt_callbacks update_weights: the update was abandoned; %d layers keep their previous weights%s",
                len(put_back),
                f", {len(processed)} already applied hold this round's (all_or_nothing is off)" if processed else "",
            )

    VLLMTorchDistWeightTransferEngine.__module__ = __name__
    VLLMTorchDistWeightTransferEngine.__qualname__ = ENGINE_CLASS_NAME
    return VLLMTorchDistWeightTransferEngine


class _LoadTracker:
    """Stands in for the model during one receive: forwards ``load_weights``
    and remembers the ``(name, dtype, shape)`` the loader is working on."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.last: tuple[str, str, list[int]] | None = None

    def load_weights(self, weights: Any) -> Any:
        """``last`` is None while a tensor is being received, so a transfer
        error (trainer gone) is not blamed on the tensor loaded before it."""
        items = iter(weights)

        def tracked() -> Any:
            while True:
                self.last = None
                try:
                    name, tensor = next(items)
                except StopIteration:
                    return
                self.last = (name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
                yield name, tensor

        result = self.model.load_weights(tracked())
        self.last = None
        return result
