"""Accelerate: ``WeightSyncHook`` keeps inference servers on the model being trained.

Accelerate has no step callbacks and no global step, so the hook counts real
optimizer steps itself::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with WeightSyncHook(accelerator, model, optimizer, hparams="weight_sync.yaml") as hook:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()            # the hook syncs after every N real steps
                optimizer.zero_grad()

With ``optimizer`` given, a post-step hook on the optimizer Accelerate steps
(under DeepSpeed: around the engine's step, which ``accelerator.backward``
runs) counts only steps that update the weights: never gradient-accumulation
micro-steps, never steps skipped on an overflow. Without it, call
``hook.step()`` after ``optimizer.step()``; it counts a step only when
``accelerator.sync_gradients`` is true and the step was not skipped.
All the work is done by ``wt_callbacks.sync.WeightSync``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from wt_callbacks.config import SyncConfig
from wt_callbacks.sync import Collectives, SyncResult, WeightSync, trainer_ranks

logger = get_logger(__name__)


class _EngineStepHooks:
    """``before()`` and ``after()`` around a DeepSpeed engine's ``step()``.

    Under DeepSpeed, Accelerate runs the real optimizer step inside
    ``accelerator.backward`` (``engine.step()``); the optimizer it returns
    steps nothing, and neither it nor DeepSpeed's ZeRO optimizer has step
    hooks. (A hook on the torch optimizer DeepSpeed wraps would fire before
    ZeRO copies the updated weights back: a stale round.) ``after`` runs
    only for steps that updated the weights (``was_step_applied``: not an
    accumulation micro-step, not skipped on an overflow).
    """

    def __init__(self, engine: Any, before: Any, after: Any) -> None:
        self._engine = engine
        step = engine.step

        def hooked(*args: Any, **kwargs: Any) -> Any:
            before()
            result = step(*args, **kwargs)
            if engine.was_step_applied():
                after()
            return result

        engine.step = hooked

    def remove(self) -> None:
        del self._engine.step  # the class's step again


class WeightSyncHook:
    """Pushes an Accelerate-prepared model's weights to inference servers on cadence.

    Args:
        accelerator: the ``Accelerator`` that prepared ``model``.
        model: the model ``accelerator.prepare`` returned: DDP, FSDP (version
            1 or 2), a DeepSpeed engine (any ZeRO stage), compiled. The
            sharding is detected, wrapper name prefixes are stripped.
        optimizer: the optimizer returned by ``accelerator.prepare`` (or the
            one you passed to it); with it, syncs follow real optimizer steps
            on their own.
        hparams: the ``weight_sync`` section, or a container holding it under
            ``hparams_key``: a dict (e.g. the one given to
            ``accelerator.init_trackers(config=...)``), an ``argparse.Namespace``
            or a YAML file path.
        hparams_key: the section's key in ``hparams``.
        client: a ready ``VLLMWeightSyncClient`` instead of one built from
            ``servers`` / ``ray_actors``.
        **overrides: ``weight_sync`` keys (see ``SyncConfig``); they win over
            ``hparams``. Unknown keys fail here, with a did-you-mean.

    The hook registers itself with ``accelerator.register_for_checkpointing``:
    ``save_state``/``load_state`` keep its step and version counters. The
    cold sync (``sync_on_fit_start``) runs before the first real optimizer
    step when ``optimizer`` is given, so after a ``load_state`` it sends the
    restored weights; without ``optimizer`` it runs at construction and again
    at ``load_state``. ``close()`` runs the final sync (``sync_on_train_end``).
    Metrics go to ``accelerator.log``, one row per round.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        hparams: Any = None,
        hparams_key: str = "weight_sync",
        client: Any = None,
        **overrides: Any,
    ) -> None:
        self.config = SyncConfig.from_hparams(hparams, key=hparams_key, **overrides)
        self.accelerator = accelerator
        self.global_step = 0
        self._failures_reported = 0
        self._handles: list[Any] = []
        prepared = self._prepared_optimizer(optimizer) if optimizer is not None else None
        self.weight_sync = WeightSync(self.config, client=client, log=logger.info)
        rank, world_size = trainer_ranks(accelerator.process_index, accelerator.num_processes)
        self.weight_sync.setup(
            # As prepare returned it (FSDP1 root unit, DeepSpeed engine, DDP):
            # the sharding scheme is detected there, wrapper names are stripped.
            model,
            rank=rank,
            world_size=world_size,
            collectives=Collectives.from_torch_distributed() if world_size > 1 else None,
        )
        accelerator.register_for_checkpointing(self)
        if prepared is not None:
            # The cold sync waits for the first real step, so a load_state()
            # in between sends the restored weights, not the initial ones.
            self._cold_sync_pending = True
            self._handles = self._hook_steps(prepared)
        else:
            self._cold_sync_pending = False
            self.weight_sync.sync_at_fit_start(self.global_step)
            self._report()

    def _prepared_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """The accelerator's wrapper of ``optimizer`` (given as prepare returned
        it, or as it was passed to prepare)."""
        for prepared in self.accelerator._optimizers:
            inner = prepared.optimizer
            # Under DeepSpeed, prepare's optimizer wraps DeepSpeed's, which wraps the one given.
            if optimizer is prepared or optimizer is inner or optimizer is getattr(inner, "optimizer", None):
                return prepared
        raise ValueError(
            "optimizer was not prepared by this accelerator: pass the optimizer returned by "
            "accelerator.prepare(...) (or leave optimizer out and call hook.step() after each step)"
        )

    def _hook_steps(self, prepared: Any) -> list[Any]:
        """Hooks before and after each real optimizer step: on the torch
        optimizer Accelerate steps, or around DeepSpeed's engine step."""
        engine = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        if engine is not None:
            return [_EngineStepHooks(engine.engine, self._flush_cold_sync, self._count_step)]
        inner = prepared.optimizer
        return [
            inner.register_step_pre_hook(lambda *_: self._flush_cold_sync()),
            inner.register_step_post_hook(lambda *_: self._count_step()),
        ]

    # -- steps and cadence ---------------------------------------------------

    def _flush_cold_sync(self) -> None:
        if self._cold_sync_pending:
            self._cold_sync_pending = False
            self.weight_sync.sync_at_fit_start(self.global_step)
            self._report()

    def _count_step(self) -> None:
        self.global_step += 1
        self.weight_sync.maybe_sync(self.global_step)
        self._report()

    def step(self) -> None:
        """Count an optimizer step (only when no ``optimizer`` was given).

        Call after ``optimizer.step()`` on every process; accumulation
        micro-steps and steps skipped on AMP overflow are not counted.
        """
        if self._handles:
            raise RuntimeError("this hook counts steps through the optimizer it was given: do not call step()")
        if self.accelerator.sync_gradients and not self.accelerator.optimizer_step_was_skipped:
            self._count_step()

    def epoch_end(self) -> None:
        """Call at the end of each epoch (every process) for ``every_n_epochs``."""
        self.weight_sync.maybe_sync(self.global_step, epoch_end=True)
        self._report()

    def sync_now(self, version: str | None = None, *, verify: bool = False) -> SyncResult | None:
        """Sync right now; call on every process. ``verify`` checks what the
        servers serve afterwards (see ``wt_callbacks.verify``). ``None`` if it
        failed under ``on_error="warn"``."""
        result = self.weight_sync.sync(self.global_step, version, verify=verify)
        if result is not None:
            self._cold_sync_pending = False
        self._report()
        return result

    # -- lifecycle -----------------------------------------------------------

    def close(self) -> None:
        """Final sync (``sync_on_train_end``), then leave the servers' group."""
        if self.weight_sync.source is None:
            return
        try:
            self.weight_sync.sync_at_train_end(self.global_step)
            self._report()
        finally:
            self._remove_handles()
            self.weight_sync.close()

    def _remove_handles(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> WeightSyncHook:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            # No final sync of a run that crashed; just leave the group.
            self._remove_handles()
            self.weight_sync.close()

    # -- checkpointing -------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step, **self.weight_sync.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counters; called by ``accelerator.load_state`` on every
        process after the model weights are restored. A cold sync of the
        restored weights follows: before the next real step (``optimizer=``
        given) or right away."""
        state = dict(state)
        self.global_step = int(state.pop("global_step"))
        self.weight_sync.load_state_dict(state)
        self._failures_reported = self.weight_sync.failures
        if self._handles:
            self._cold_sync_pending = True
        else:
            self.weight_sync.sync_at_fit_start(self.global_step)
            self._report()

    # -- metrics -------------------------------------------------------------

    def _report(self) -> None:
        """One ``accelerator.log`` row per acknowledged round (``WeightSync.take_results``),
        at the current step: its ``metrics()`` with the gauges; or the gauges
        alone after a failed round (without a new failure or round nothing is
        logged). Accelerate has no logging cadence to put the gauges on; for
        your own, log ``hook.weight_sync.gauges(hook.global_step)``.
        (``WeightSync`` itself logs the round's line, through this module's
        main-process logger.)"""
        ws = self.weight_sync
        results: list[SyncResult | None] = list(ws.take_results())
        if not results and ws.failures == self._failures_reported:
            return
        self._failures_reported = ws.failures
        for result in results or [None]:
            metrics = {**(result.metrics() if result is not None else {}), **ws.gauges(self.global_step)}
            self.accelerator.log(metrics, step=self.global_step)
