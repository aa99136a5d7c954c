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
counts only steps that update the weights: never gradient-accumulation
micro-steps, never steps skipped on an AMP overflow. Without it, call
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
from wt_callbacks.sync import Collectives, SyncResult, WeightSync

logger = get_logger(__name__)


def _refuse_flat_shards(accelerator: Accelerator) -> None:
    """FSDP1 and DeepSpeed ZeRO-3 expose flattened or empty shards as
    parameters; sending them would fail on the server, or worse."""
    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None)
    if deepspeed is not None and getattr(deepspeed, "zero_stage", 0) == 3:
        raise ValueError(
            "WeightSyncHook does not support DeepSpeed ZeRO stage 3 (partitioned parameters); "
            "use FSDP2 (fsdp_version: 2) or ZeRO stage 1/2"
        )
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is not None and getattr(plugin, "fsdp_version", 1) == 1:
        raise ValueError(
            "WeightSyncHook does not support FSDP1 (fsdp_version: 1): its parameters are flat shards. "
            "Set fsdp_version: 2 in the Accelerate config; FSDP2's DTensor parameters are gathered "
            "one at a time"
        )


class WeightSyncHook:
    """Pushes an Accelerate-prepared model's weights to inference servers on cadence.

    Args:
        accelerator: the ``Accelerator`` that prepared ``model``.
        model: the prepared model (DDP / compiled wrappers are unwrapped, and
            their name prefixes stripped).
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
        _refuse_flat_shards(accelerator)
        self.config = SyncConfig.from_hparams(hparams, key=hparams_key, **overrides)
        self.accelerator = accelerator
        self.global_step = 0
        self._failures_reported = 0
        self._handles: list[Any] = []
        inner = self._inner_optimizer(optimizer) if optimizer is not None else None
        self.weight_sync = WeightSync(self.config, client=client, log=logger.info)
        world_size = accelerator.num_processes
        self.weight_sync.setup(
            accelerator.unwrap_model(model),
            rank=accelerator.process_index,
            world_size=world_size,
            collectives=Collectives.from_torch_distributed() if world_size > 1 else None,
        )
        accelerator.register_for_checkpointing(self)
        if inner is not None:
            # The cold sync waits for the first real step, so a load_state()
            # in between sends the restored weights, not the initial ones.
            self._cold_sync_pending = True
            self._handles = [
                inner.register_step_pre_hook(lambda *_: self._flush_cold_sync()),
                inner.register_step_post_hook(lambda *_: self._count_step()),
            ]
        else:
            self._cold_sync_pending = False
            self._report(self.weight_sync.sync_at_fit_start(self.global_step))

    def _inner_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The torch optimizer Accelerate steps: the hook must sit on it, not
        on a wrapper or on an optimizer Accelerate never steps."""
        for prepared in self.accelerator._optimizers:
            if optimizer is prepared or optimizer is prepared.optimizer:
                return prepared.optimizer
        raise ValueError(
            "optimizer was not prepared by this accelerator: pass the optimizer returned by "
            "accelerator.prepare(...) (or leave optimizer out and call hook.step() after each step)"
        )

    # -- steps and cadence ---------------------------------------------------

    def _flush_cold_sync(self) -> None:
        if self._cold_sync_pending:
            self._cold_sync_pending = False
            self._report(self.weight_sync.sync_at_fit_start(self.global_step))

    def _count_step(self) -> None:
        self.global_step += 1
        ran = self.weight_sync.maybe_sync(self.global_step)
        self._report(self.weight_sync.last_result if ran else None)

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
        ran = self.weight_sync.maybe_sync(self.global_step, epoch_end=True)
        self._report(self.weight_sync.last_result if ran else None)

    def sync_now(self, version: str | None = None, *, verify: bool = False) -> SyncResult | None:
        """Sync right now; call on every process. ``verify`` checks what the
        servers serve afterwards (see ``wt_callbacks.verify``). ``None`` if it
        failed under ``on_error="warn"``."""
        result = self.weight_sync.sync(self.global_step, version, verify=verify)
        if result is not None:
            self._cold_sync_pending = False
        self._report(result)
        return result

    # -- lifecycle -----------------------------------------------------------

    def close(self) -> None:
        """Final sync (``sync_on_train_end``), then leave the servers' group."""
        if self.weight_sync.source is None:
            return
        try:
            self._report(self.weight_sync.sync_at_train_end(self.global_step))
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
            self._report(self.weight_sync.sync_at_fit_start(self.global_step))

    # -- metrics -------------------------------------------------------------

    def _report(self, result: SyncResult | None) -> None:
        """One ``accelerator.log`` row per round, at its step: ``result.metrics()``
        with the gauges, or the gauges alone after a failed round (``result``
        is ``None`` then; without a new failure nothing ran and nothing is
        logged). Accelerate has no logging cadence to put the gauges on; for
        your own, log ``hook.weight_sync.gauges(hook.global_step)``.
        (``WeightSync`` itself logs the round's line, through this module's
        main-process logger.)"""
        ws = self.weight_sync
        if result is None and ws.failures == self._failures_reported:
            return
        self._failures_reported = ws.failures
        metrics = {**(result.metrics() if result is not None else {}), **ws.gauges(self.global_step)}
        self.accelerator.log(metrics, step=self.global_step)
