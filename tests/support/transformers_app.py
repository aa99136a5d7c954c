"""A small ``transformers.Trainer`` run with WeightSyncTrainerCallback, used by the tests.

Runs in the pytest process (``run(...)``) or under torchrun (``python -m
torch.distributed.run ... -m tests.support.transformers_app --out result.json
...``, from the repository root). The model is the toy task's causal LM;
receivers serve ``wt_callbacks.demos.toy_task:served_model``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from wt_callbacks.checksums import module_checksums
from wt_callbacks.demos import toy_task
from wt_callbacks.demos.multiprocess import leave_group_together
from wt_callbacks.integrations.transformers import WeightSyncTrainerCallback


@dataclass
class SyncTrainingArguments(TrainingArguments):
    """A user's TrainingArguments subclass carrying the weight_sync section."""

    weight_sync: dict = field(default_factory=dict)


class ReversalRows(torch.utils.data.Dataset):
    def __init__(self, n: int = 400) -> None:
        batch = toy_task.training_batch(toy_task.build_tokenizer(), random.Random(0), n)
        self.rows = [{"input_ids": batch["input_ids"][i], "labels": batch["labels"][i]} for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def training_arguments(out_dir: str, max_steps: int, **extra: Any) -> dict[str, Any]:
    """What every run shares: CPU, 2 micro-batches per optimizer step, a log row per step."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return dict(
        output_dir=out_dir, use_cpu=True, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=max_steps, learning_rate=2e-3, logging_steps=1, save_strategy="steps", save_steps=6,
        report_to=[], disable_tqdm=True, seed=0, ddp_backend="gloo" if distributed else None, **extra,
    )  # fmt: skip


def run(
    out_dir: str,
    *,
    weight_sync: dict | None = None,
    callbacks: list[dict[str, Any]] = (),
    max_steps: int = 10,
    resume_from: str | None = None,
    rows: int = 400,
) -> dict[str, Any]:
    """Train the toy LM on ``rows`` examples (8 per optimizer step);
    ``weight_sync`` is the TrainingArguments field, each dict of
    ``callbacks`` the keyword arguments of one added callback."""
    model = toy_task.build_model(toy_task.build_tokenizer(), seed=0)
    args = SyncTrainingArguments(weight_sync=weight_sync or {}, **training_arguments(out_dir, max_steps))
    trainer = Trainer(model=model, args=args, train_dataset=ReversalRows(rows))
    for kwargs in callbacks:
        trainer.add_callback(WeightSyncTrainerCallback(trainer, **kwargs))
    trainer.train(resume_from_checkpoint=resume_from)
    return result(trainer)


def result(trainer: Trainer) -> dict[str, Any]:
    """What rank 0 saw: its checksums, the weight_sync rows of the log history."""
    rows = [
        {k: v for k, v in row.items() if k == "step" or k.startswith("weight_sync/")}
        for row in trainer.state.log_history
        if any(k.startswith("weight_sync/") for k in row)
    ]
    return {
        "rank": trainer.args.process_index,
        "world_size": trainer.args.world_size,
        "global_step": trainer.state.global_step,
        "checksums": module_checksums(trainer.model),
        "synced": [(r["step"], r["weight_sync/step"]) for r in rows if "weight_sync/syncs_completed" in r],
        "steps_behind": [(r["step"], r["weight_sync/steps_behind"]) for r in rows if "weight_sync/steps_behind" in r],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    section = {"servers": [args.server], "every_n_train_steps": args.every, "timeout_s": 60}
    outcome = run(args.out_dir, weight_sync=section, callbacks=[{}], max_steps=args.max_steps)
    if outcome["rank"] == 0:
        Path(args.out).write_text(json.dumps(outcome))
    leave_group_together()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
