"""A small Lightning training run with WeightSyncCallback, used by the tests.

Runs in the pytest process (``run(...)``) or under torchrun for the
multi-process strategies (``python -m torch.distributed.run ... -m
tests.support.lightning_app --out result.json ...``, from the repository
root). Rank 0 writes what the test checks: the trainer's
final checksums (gathered, so sharded parameters are compared whole) and the
callback's state.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from wt_callbacks.demos import models, tiny_lms, toy_task
from wt_callbacks.demos.full_weights import full_checksums
from wt_callbacks.demos.multiprocess import leave_group_together
from wt_callbacks.integrations.lightning import WeightSyncCallback
from wt_callbacks.transfer import materialize_full_tensor


class RandomRegression(Dataset):
    """A fixed-size dataset so epochs have a known number of batches."""

    def __init__(self, batches: int, batch_size: int = 8, width: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(batches * batch_size, width, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


class TinyModule(pl.LightningModule):
    """``self.model`` is what the receivers host (wt_callbacks.demos.models.TinyMLP)."""

    def __init__(self, weight_sync: dict, shard: bool = False, step_sleep_s: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = models.tiny_mlp(seed=0)

    def configure_model(self) -> None:
        if not self.hparams.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.hparams.step_sleep_s:
            time.sleep(self.hparams.step_sleep_s)
        return self.model(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class ToyLMModule(pl.LightningModule):
    """The quickstart's causal LM (``self.model`` is a transformers Llama), or
    one of ``wt_callbacks.demos.tiny_lms`` (``family``), learning the toy task,
    for syncing into a real vLLM server serving the same architecture."""

    def __init__(
        self, weight_sync: dict, shard: bool = False, step_sleep_s: float = 0.0, family: str | None = None,
        peft: dict | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.tokenizer = toy_task.build_tokenizer()
        self.model = tiny_lms.TINY_LMS[family](seed=0) if family else toy_task.build_model(self.tokenizer, seed=0)
        if peft is not None:  # a LoRA of the model, as PEFT users write it: self.model = get_peft_model(...)
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(**peft))
        self._rng = random.Random(0)

    def configure_model(self) -> None:
        if not self.hparams.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        blocks = next(m for m in self.model.modules() if isinstance(m, torch.nn.ModuleList))  # the decoder layers
        for layer in blocks:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.hparams.step_sleep_s:
            time.sleep(self.hparams.step_sleep_s)
        return self.model(**toy_task.training_batch(self.tokenizer, self._rng, 16)).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class IteratorStepModule(TinyModule):
    """``training_step`` takes the ``dataloader_iter`` (custom RL and streaming
    loops do): Lightning then wants a ``batch_size`` in every ``self.log``."""

    def training_step(self, dataloader_iter) -> torch.Tensor:  # type: ignore[override]
        batch, batch_idx, _ = next(dataloader_iter)
        return super().training_step(batch, batch_idx)


TASKS = {"regression": TinyModule, "toy-lm": ToyLMModule, "dataloader-iter": IteratorStepModule}


class FinalWeights(pl.Callback):
    """The checksums the servers must hold at the end: gathered at
    ``on_train_end`` (after the final sync, before the strategy tears down),
    from the model as the strategy holds it (an FSDP1 root, a DeepSpeed
    engine), on every rank (a collective); names relative to ``.model``."""

    def __init__(self, via_dtype: torch.dtype | None) -> None:
        self.via_dtype = via_dtype
        self.checksums: dict[str, str] = {}

    def on_train_end(self, trainer, pl_module):
        full = full_checksums(trainer.strategy.model, via_dtype=self.via_dtype)
        self.checksums = {n.removeprefix("model."): v for n, v in full.items() if n.startswith("model.")}


class StepHook(pl.Callback):
    """Calls ``fn(step)`` once after each optimizer step (for fault injection)."""

    def __init__(self, fn) -> None:
        self.fn, self.last = fn, -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.last:
            self.last = trainer.global_step
            self.fn(trainer.global_step)


def run(
    weight_sync: dict,
    *,
    strategy: str = "auto",
    accelerator: str = "cpu",
    devices: int = 1,
    max_steps: int = -1,
    max_epochs: int | None = None,
    batches: int = 64,
    accumulate: int = 1,
    ckpt_dir: str | None = None,
    resume_from: str | None = None,
    step_sleep_s: float = 0.0,
    extra_callbacks: list[pl.Callback] | None = None,
    callback_kwargs: dict | None = None,
    extra_sync_callbacks: list[WeightSyncCallback] | None = None,
    logger: Any = False,
    log_every_n_steps: int = 50,
    task: str = "regression",
    family: str | None = None,
    peft: dict | None = None,
    state_out: str | None = None,
) -> dict:
    """Fit ``TinyModule`` with a ``WeightSyncCallback``; returns what rank 0 saw."""
    shard = strategy == "model_parallel"
    if shard:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy_obj = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    else:
        strategy_obj = strategy
    sync = WeightSyncCallback(**(callback_kwargs or {}))
    wire = weight_sync.get("dtype")
    final = FinalWeights(getattr(torch, wire) if wire else None)
    callbacks: list[pl.Callback] = [sync, *(extra_sync_callbacks or []), *(extra_callbacks or []), final]
    if ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy_obj,
        max_steps=max_steps,
        max_epochs=max_epochs,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=log_every_n_steps,
        enable_checkpointing=bool(ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options = {**({"family": family} if family else {}), **({"peft": peft} if peft else {})}
    module = TASKS[task](weight_sync, shard=shard, step_sleep_s=step_sleep_s, **options)
    trainer.fit(module, DataLoader(RandomRegression(batches), batch_size=8), ckpt_path=resume_from)
    if state_out:
        # Full tensors (a gather per sharded parameter: every rank), saved by rank 0.
        state = {n: materialize_full_tensor(p.detach()) for n, p in module.model.named_parameters()}
        if trainer.global_rank == 0:
            torch.save(state, state_out)
    return {
        "global_step": trainer.global_step,
        "checksums": final.checksums,
        "state": sync.state_dict(),
        "rank": trainer.global_rank,
        "sharded": any(type(p).__name__ == "DTensor" for p in module.model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weight-sync", required=True, help="JSON of the weight_sync section")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--task", choices=sorted(TASKS), default="regression")
    parser.add_argument("--family", choices=sorted(tiny_lms.TINY_LMS), help="with --task toy-lm: the model family")
    parser.add_argument("--peft", help="with --task toy-lm: JSON of a peft.LoraConfig wrapping the model")
    parser.add_argument("--state-out", help="save the trained model's full state dict here (rank 0)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = run(
        json.loads(args.weight_sync),
        strategy=args.strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        max_steps=args.max_steps,
        accumulate=args.accumulate,
        task=args.task,
        family=args.family,
        peft=json.loads(args.peft) if args.peft else None,
        state_out=args.state_out,
    )
    if result["rank"] == 0:
        Path(args.out).write_text(json.dumps(result))
    leave_group_together()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
