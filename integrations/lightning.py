"""Lightning: ``WeightSyncCallback`` keeps inference servers on the model being trained.

Add the callback, put a ``weight_sync`` section in the LightningModule's
hyperparameters (or pass the same keys as arguments), and the servers serve
the new weights on cadence::

    class Policy(L.LightningModule):
        def __init__(self, weight_sync: dict):
            super().__init__()
            self.save_hyperparameters()
            self.model = AutoModelForCausalLM.from_config(...)

    trainer = L.Trainer(callbacks=[WeightSyncCallback()], max_steps=1000)
    trainer.fit(Policy(weight_sync={"servers": ["http://127.0.0.1:8000"],
                                    "every_n_train_steps": 10, "module": "model"}))

The cadence follows ``ModelCheckpoint``: ``every_n_train_steps`` counts
optimizer steps (``trainer.global_step``, so gradient accumulation does not
multiply syncs), ``every_n_epochs``, or ``train_time_interval`` (decided on
rank 0 and broadcast). Sanity checking and ``fast_dev_run`` never sync. All
the work is done by ``wt_callbacks.sync.WeightSync``; this module only maps
Lightning's hooks onto it.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from wt_callbacks.config import SyncConfig, shared_resume_state_error
from wt_callbacks.sync import Collectives, SyncResult, WeightSync


class WeightSyncCallback(Callback):
    """Pushes the LightningModule's weights to inference servers on cadence.

    Every argument but ``hparams_key`` and ``client`` is a key of the
    ``weight_sync`` section (see ``wt_callbacks.config.SyncConfig`` for their
    meaning); an argument given here overrides the hyperparameter. The
    configuration is resolved and validated in ``setup``, before the first
    training step, so a typo never waits for the first sync to fail.

    Args:
        hparams_key: where the section lives in ``pl_module.hparams``.
        client: a ready ``VLLMWeightSyncClient`` to use instead of one built
            from ``servers`` / ``ray_actors``.

    Strategies: single device, DDP, ``ModelParallelStrategy`` (FSDP2),
    ``FSDPStrategy`` (FSDP1, either ``use_orig_params``) and
    ``DeepSpeedStrategy`` (every ZeRO stage); the sharding is detected from
    the strategy's model, and the parameters are gathered a bounded piece at
    a time.

    Lifecycle: the engine is created at fit start on every rank (after
    ``configure_model`` and the strategy's wrapping), a cold sync
    runs before the first step and again after a resume, and everything is
    torn down in ``teardown`` and on exceptions (servers resumed if paused).
    Call ``sync_now(trainer)`` on every rank for custom cadences.
    """

    def __init__(
        self,
        *,
        backend: str | None = None,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        train_time_interval: float | datetime.timedelta | None = None,
        sync_on_fit_start: bool | None = None,
        sync_on_train_end: bool | None = None,
        servers: list[str] | None = None,
        ray_actors: list[str] | None = None,
        ray_namespace: str | None = None,
        module: str | None = None,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        dtype: str | None = None,
        pause: str | None = None,
        commit: str | None = None,
        send: str | None = None,
        async_overflow: str | None = None,
        staging_nice: int | None = None,
        init_info: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        on_error: str | None = None,
        api_key: str | None = None,
        verify_every_n_syncs: int | None = None,
        verify_tolerance: float | None = None,
        lora: str | None = None,
        lora_name: str | None = None,
        send_frozen: str | None = None,
        hparams_key: str = "weight_sync",
        client: Any = None,
    ) -> None:
        # The keyword arguments above spell SyncConfig's fields out because
        # LightningCLI reads a typed signature; the fields, not a second list,
        # say which of them are overrides (a test holds the two equal).
        arguments = locals()
        self._overrides = {f.name: arguments[f.name] for f in dataclasses.fields(SyncConfig)}
        self.hparams_key = hparams_key
        self._client = client
        self.config: SyncConfig | None = None
        self.weight_sync: WeightSync | None = None
        self._restored: dict[str, Any] | None = None  # from the checkpoint the next fit resumes
        self._final: dict[str, Any] | None = None  # the last fit's, for a checkpoint written after it

    # -- identity and resume state -----------------------------------------

    @property
    def state_key(self) -> str:
        # What the callback syncs, not where to: a restarted job's servers
        # often have new hosts or ports, and a key holding them would drop
        # the resume state (ModelCheckpoint leaves its dirpath out too). Two
        # callbacks differ in their section or their submodule (setup checks).
        cfg = self.config
        module = cfg.module if cfg is not None else self._overrides.get("module")
        return self._generate_state_key(module=module, hparams_key=self.hparams_key)

    def state_dict(self) -> dict[str, Any]:
        if self.weight_sync is not None:
            return self.weight_sync.state_dict()
        return dict(self._restored or self._final or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Strategies that restore after setup (ModelParallel, FSDP, DeepSpeed)
        # call this after on_fit_start built the driver, still before
        # on_train_start's cold sync: the counters go straight into it.
        if self.weight_sync is not None:
            self.weight_sync.load_state_dict(state_dict)
            return
        # Otherwise Lightning restores callbacks before on_fit_start builds the
        # driver. Only a checkpoint restores counters: a fit without one (this
        # callback reused for another run) starts them at zero, or the last
        # run's synced step would keep the new run's same step from the servers.
        self._restored = dict(state_dict)

    # -- configuration -----------------------------------------------------

    def resolve_config(self, pl_module: pl.LightningModule) -> SyncConfig:
        """The effective ``SyncConfig``: ``pl_module.hparams[hparams_key]``
        overridden by this callback's arguments."""
        hparams = getattr(pl_module, "hparams", None) or {}
        section = {self.hparams_key: hparams[self.hparams_key]} if self.hparams_key in hparams else None
        return SyncConfig.from_hparams(section, key=self.hparams_key, **self._overrides)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.config = self.resolve_config(pl_module)
        twins = [c for c in trainer.callbacks if isinstance(c, WeightSyncCallback) and c is not self and c.config]
        if any(c.state_key == self.state_key for c in twins):
            raise shared_resume_state_error(type(self).__name__, self.hparams_key, self.config.module)

    def _active(self, trainer: pl.Trainer) -> bool:
        return self.weight_sync is not None and not trainer.sanity_checking

    # -- fit lifecycle -----------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.config is None or trainer.fast_dev_run:
            return
        strategy = trainer.strategy
        self.weight_sync = WeightSync(self.config, client=self._client, log=rank_zero_info)
        restored, self._restored = self._restored, None
        if restored:
            self.weight_sync.load_state_dict(restored)
        self.weight_sync.setup(
            # As the strategy holds it (FSDP1 root unit, DeepSpeed engine, DDP):
            # the sharding scheme is detected there, wrapper names are stripped.
            strategy.model,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            collectives=Collectives(
                broadcast=lambda obj: strategy.broadcast(obj, src=0),
                any_flag=lambda flag: strategy.reduce_boolean_decision(flag, all=False),
            ),
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active(trainer):
            self.weight_sync.sync_at_fit_start(trainer.global_step)
            self._report(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Called after every micro-batch; global_step moves once per optimizer
        # step and WeightSync ignores repeats, so accumulation is handled.
        if not self._active(trainer):
            return
        self.weight_sync.maybe_sync(trainer.global_step)
        self._report(trainer)
        # Gauges go through Lightning's own logging, which sends the latest
        # value every log_every_n_steps (a sync row must not: see _report).
        # Step values, never averaged over batches: the batch size is moot,
        # and Lightning demands one when training_step takes a dataloader_iter.
        pl_module.log_dict(
            self.weight_sync.gauges(trainer.global_step),
            on_step=True, on_epoch=False, rank_zero_only=True, sync_dist=False, batch_size=1,
        )  # fmt: skip

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # ModelCheckpoint's count: a callback added at a resume, or reused
        # for another fit, follows the trainer's epochs, not its own calls.
        epochs_done = trainer.current_epoch + 1
        if self._active(trainer):
            self.weight_sync.maybe_sync(trainer.global_step, epoch_end=True, epochs_done=epochs_done)
            self._report(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active(trainer):
            self.weight_sync.sync_at_train_end(trainer.global_step)
            self._report(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.weight_sync is not None:
            self._final = self.weight_sync.state_dict()
            self.weight_sync.close()
            self.weight_sync = None

    # -- manual syncs and metrics ------------------------------------------

    def sync_now(self, trainer: pl.Trainer, version: str | None = None, *, verify: bool = False) -> SyncResult | None:
        """Sync right now (e.g. after each rollout batch of a custom loop).

        Call on every rank: the gathers of a sharded model are collectives.
        ``verify`` checks what the servers serve afterwards (see
        ``wt_callbacks.verify``). Returns the round's metrics, or ``None`` if
        it failed under ``on_error="warn"``.
        """
        if self.weight_sync is None:
            raise RuntimeError("sync_now() works between on_fit_start and teardown of a fit")
        result = self.weight_sync.sync(trainer.global_step, version, verify=verify)
        self._report(trainer)
        return result

    def _report(self, trainer: pl.Trainer) -> None:
        """Each acknowledged round's ``metrics()`` straight to every logger, once, on
        Lightning's logging axis (``WeightSync.take_results``).

        A round is an event: through ``pl_module.log`` Lightning would keep
        the value and send it again at every ``log_every_n_steps`` until the
        epoch ends, so the logs would show a sync on every step. (``WeightSync``
        itself logs the round's line, through ``rank_zero_info``.)
        """
        results = self.weight_sync.take_results()  # on every rank, so none piles up
        if not trainer.is_global_zero:
            return
        # The step Lightning logs its own rows at (LearningRateMonitor's too):
        # batches that stepped, where global_step counts every optimizer's
        # steps (twice as fast with an actor and a critic). The round's
        # optimizer step is in the row as weight_sync/step.
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        for result in results:
            for logger in trainer.loggers:
                logger.log_metrics(result.metrics(), step=step)
