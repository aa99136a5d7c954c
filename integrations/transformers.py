"""transformers: ``WeightSyncTrainerCallback`` keeps inference servers on a ``Trainer``'s model.

Add the callback, give it the ``weight_sync`` section (or the same keys as
arguments), and the servers serve the new weights on cadence::

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.add_callback(WeightSyncTrainerCallback(trainer, servers=["http://127.0.0.1:8000"],
                                                   every_n_train_steps=10))
    trainer.train()

TRL's trainers (``SFTTrainer``, ``GRPOTrainer``, ...) subclass ``Trainer``:
the same two lines. Where things come from (transformers 5):

* cadence: ``on_step_end`` fires once per optimizer step, after
  ``state.global_step`` moved (micro-batches fire ``on_substep_end``), so
  gradient accumulation never multiplies syncs.
* the model: the callbacks' ``model`` is the user's ``PreTrainedModel``
  under DDP and DeepSpeed (the wrapper is ``trainer.model_wrapped``) and the
  prepared root under FSDP2, which shards in place (same names, DTensor
  parameters, gathered one at a time). FSDP1 and ZeRO-3 are refused.
* ranks: every process calls every event; they share torch.distributed's
  default group (Accelerate's), which carries the ranks' agreement.
* resume: ``on_train_begin`` runs after a checkpoint's weights and
  ``trainer_state.json`` were loaded, so the cold sync sends the restored
  weights. The callback's counters travel in the checkpoint through
  transformers' ``ExportableState`` (``state.stateful_callbacks``), and the
  callback reads them back itself: transformers' own restore
  (``restore_callback_states_from_checkpoint``) is off by default, and when on
  it replaces the callback by ``type(callback)(**args)``, which cannot carry
  the ``trainer``.
* metrics: through the base ``Trainer.log``, so they reach the log history
  and every ``report_to`` integration. A callback cannot add them to the
  Trainer's own rows: reporters run before user callbacks, and the row is in
  the history before ``on_log``. Hence the ``trainer`` argument (as TRL's
  ``LogCompletionsCallback(trainer)``).

All the work is done by ``wt_callbacks.sync.WeightSync``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from wt_callbacks.config import SyncConfig, shared_resume_state_error
from wt_callbacks.sync import Collectives, WeightSync, trainer_ranks

logger = logging.getLogger(__name__)


def _refuse_flat_shards(model: torch.nn.Module) -> None:
    """FSDP1 and DeepSpeed ZeRO-3 expose flat or empty shards as parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise ValueError(
            "WeightSyncTrainerCallback does not support DeepSpeed ZeRO stage 3 (partitioned parameters); "
            "use FSDP2 (fsdp_config={'version': 2}) or ZeRO stage 1/2"
        )
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ValueError(
            "WeightSyncTrainerCallback does not support FSDP1 (fsdp_config['version'] = 1): its parameters "
            "are flat shards. Use FSDP2 (fsdp_config={'version': 2})"
        )


class WeightSyncTrainerCallback(TrainerCallback, ExportableState):
    """Pushes a ``transformers.Trainer``'s model to inference servers on cadence.

    Every keyword argument but ``hparams``, ``hparams_key`` and ``client`` is
    a key of the ``weight_sync`` section (see ``wt_callbacks.config.SyncConfig``)
    and overrides it. The configuration is validated when the Trainer is
    built (callback given to ``Trainer(callbacks=...)``) or at train begin
    (``trainer.add_callback``), before the first step.

    Args:
        trainer: the Trainer this callback is added to; its ``log`` carries the
            metrics to the log history and to every ``report_to``
            integration. ``None``: the metrics go to ``state.log_history`` only.
        hparams: the section, or a container holding it under ``hparams_key``:
            a dict, an ``argparse.Namespace``, a YAML file path or a JSON object
            string. Default: the ``hparams_key`` field of the
            ``TrainingArguments`` (a subclass with a ``weight_sync`` field), if any.
        hparams_key: the section's key.
        client: a ready ``VLLMWeightSyncClient`` instead of one built from
            ``servers`` / ``ray_actors``.

    Lifecycle: cold sync at train begin (also after a resume), a round after
    every ``every_n_train_steps`` optimizer steps (or epochs, or seconds), the
    final sync at the last step, before the Trainer's last checkpoint, so the
    checkpoint records the step as served. One row per successful round in
    the Trainer's log; ``weight_sync/failures`` and ``weight_sync/steps_behind``
    on the Trainer's logging steps (``logging_steps``). A crash inside
    ``train()`` skips ``on_train_end`` (transformers has no exception event);
    the next ``train()`` leaves the old transfer group first.
    """

    def __init__(
        self,
        trainer: Trainer | None = None,
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
        hparams: Any = None,
        hparams_key: str = "weight_sync",
        client: Any = None,
    ) -> None:
        # Spelled out for typed, documented keywords; SyncConfig's fields, not
        # a second list, say which are overrides (a test holds the two equal).
        arguments = locals()
        self._overrides = {f.name: arguments[f.name] for f in dataclasses.fields(SyncConfig)}
        self.trainer = trainer
        self.hparams = hparams
        self.hparams_key = hparams_key
        self._client = client
        self.config: SyncConfig | None = None
        self.weight_sync: WeightSync | None = None
        self._restored: dict[str, Any] | None = None

    # -- configuration -------------------------------------------------------

    def resolve_config(self, args: TrainingArguments) -> SyncConfig:
        """``hparams`` (or the ``TrainingArguments`` field ``hparams_key``)
        overridden by this callback's keyword arguments."""
        section = self.hparams if self.hparams is not None else getattr(args, self.hparams_key, None)
        return SyncConfig.from_hparams(section, key=self.hparams_key, **self._overrides)

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        # Only for Trainer(callbacks=[...]): a typo fails when the Trainer is built.
        self.config = self.resolve_config(args)

    # -- resume state (ExportableState) -------------------------------------

    def _key(self) -> str:
        # Tells this callback's saved state from that of another instance
        # (another section, another submodule) in the same checkpoint: what
        # it syncs, not where to, since a restarted job's servers often have
        # new hosts or ports (two instances need different hparams_keys).
        cfg = self.config.__dict__ if self.config is not None else self._overrides
        return json.dumps([cfg.get("module"), self.hparams_key])

    def state(self) -> dict[str, Any]:
        counters = self.weight_sync.state_dict() if self.weight_sync is not None else dict(self._restored or {})
        counters.pop("key", None)
        # "args" rebuild the callback when restore_callback_states_from_checkpoint
        # is on: JSON values only, and never an api_key (trainer_state.json is
        # no place for a secret).
        given = {**self._overrides, "hparams": self.hparams}
        args = _without_api_key({k: v for k, v in given.items() if v is not None and _json_value(v)})
        args["hparams_key"] = self.hparams_key
        return {"args": args, "attributes": {"_restored": {"key": self._key(), **counters}}}

    def _refuse_twins(self) -> None:
        """Two instances with one key would restore each other's counters.
        Only the Trainer knows its callbacks: checked when it was given."""
        handler = getattr(self.trainer, "callback_handler", None)
        others = [c for c in getattr(handler, "callbacks", []) if isinstance(c, type(self)) and c is not self]
        if any(c.config is not None and c._key() == self._key() for c in others):
            raise shared_resume_state_error(type(self).__name__, self.hparams_key, self.config.module)

    def _take_saved_state(self, state: TrainerState) -> None:
        """After a resume: restore the counters this callback saved, and make
        sure transformers finds an entry for it at the next checkpoint. (A
        fresh run starts from zero; transformers made its entry at train start.)"""
        self._restored = None
        if state.global_step == 0:
            return
        name = type(self).__name__
        entry = state.stateful_callbacks.get(name)
        # Several instances of one class are saved as a list that every
        # checkpoint appends to: the last entry with this callback's key is its state.
        entries = entry if isinstance(entry, list) else [entry] if entry else []
        mine = [e for e in entries if e.get("attributes", {}).get("_restored", {}).get("key") == self._key()]
        if mine:
            self._restored = {k: v for k, v in mine[-1]["attributes"]["_restored"].items() if k != "key"}
        # _save_checkpoint indexes stateful_callbacks[name] for every stateful
        # callback (KeyError for one the checkpoint was saved without), and
        # overwrites a single entry (a second instance would erase the first).
        if not entries:
            state.stateful_callbacks[name] = self.state()
        elif not mine and not isinstance(entry, list):
            state.stateful_callbacks[name] = [entry, self.state()]

    # -- training lifecycle --------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._close()
        _refuse_flat_shards(kwargs["model"])
        if self.config is None:
            self.config = self.resolve_config(args)
        self._refuse_twins()
        self._take_saved_state(state)
        if self.trainer is None and state.is_world_process_zero:
            logger.warning(
                "WeightSyncTrainerCallback has no trainer: weight_sync metrics go to state.log_history only. "
                "Pass it (trainer.add_callback(WeightSyncTrainerCallback(trainer, ...))) to reach report_to, "
                "and leave restore_callback_states_from_checkpoint off: the callback restores itself"
            )
        self.weight_sync = WeightSync(self.config, client=self._client)
        if self._restored:
            self.weight_sync.load_state_dict(self._restored)
        rank, world_size = trainer_ranks(args.process_index, args.world_size)
        self.weight_sync.setup(
            kwargs["model"],
            rank=rank,
            world_size=world_size,
            collectives=Collectives.from_torch_distributed() if world_size > 1 else None,
        )
        self.weight_sync.sync_at_fit_start(state.global_step)
        self._report(state, control)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        ws = self.weight_sync
        if ws is None:
            return
        ws.maybe_sync(state.global_step)
        if control.should_training_stop:
            # The last step (DefaultFlowCallback, first in the list, set the
            # flag): sync before the Trainer writes its last checkpoint (a
            # no-op when this step's round just ran, but under send: async,
            # which collects it here).
            ws.sync_at_train_end(state.global_step)
        self._report(state, control)
        if control.should_log:
            self._log(state, control, ws.gauges(state.global_step))

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        ws = self.weight_sync
        # The Trainer's own count (its state.epoch reaches a whole number at
        # each epoch end), so a run resumed from a checkpoint without this
        # callback's state keeps the every_n_epochs cadence.
        epochs_done = int(state.epoch) if state.epoch is not None else None
        if ws is not None:
            ws.maybe_sync(state.global_step, epoch_end=True, epochs_done=epochs_done)
            self._report(state, control)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.weight_sync is None:
            return
        try:
            # A no-op when on_step_end sent the last step; covers stops the
            # flow callback does not announce there (early stopping).
            self.weight_sync.sync_at_train_end(state.global_step)
            self._report(state, control)
        finally:
            self._close()

    def _close(self) -> None:
        if self.weight_sync is not None:
            # Kept for a checkpoint written after train().
            self._restored = self.weight_sync.state_dict()
            self.weight_sync.close()
            self.weight_sync = None

    # -- metrics -------------------------------------------------------------

    def _report(self, state: TrainerState, control: TrainerControl) -> None:
        """A row per acknowledged round (``WeightSync.take_results``)."""
        for result in self.weight_sync.take_results():
            self._log(state, control, result.metrics())

    def _log(self, state: TrainerState, control: TrainerControl, metrics: dict[str, float]) -> None:
        """One row on every rank, as the Trainer logs its own (reporters log on rank 0)."""
        if self.trainer is None:
            state.log_history.append({**metrics, "step": state.global_step})
            return
        # The base Trainer.log, not the subclass's: TRL's trainers merge and
        # clear their pending train metrics in log(), which would move them
        # onto this row. It ends in on_log, which clears control.should_log:
        # keep the Trainer's own decision to log this step.
        should_log = control.should_log
        Trainer.log(self.trainer, dict(metrics))
        control.should_log = should_log


def _without_api_key(value: Any) -> Any:
    """``value`` with every ``api_key`` entry left out, also inside a JSON object string."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        return json.dumps(_without_api_key(json.loads(value)))
    if isinstance(value, dict):
        return {k: _without_api_key(v) for k, v in value.items() if k != "api_key"}
    return value


def _json_value(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
