"""A small ``accelerate launch`` training loop with WeightSyncHook, used by the tests
(``accelerate launch ... -m tests.support.accelerate_app``, from the repository root).

Rank 0 writes what the tests check to ``--out``: the number of processes, the
hook's counters and the trainer's checksums under checkpoint names.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

from wt_callbacks.checksums import module_checksums
from wt_callbacks.demos import models
from wt_callbacks.integrations.accelerate import WeightSyncHook
from wt_callbacks.naming import checkpoint_name


class RecordingTracker(GeneralTracker):
    """Keeps every ``accelerator.log`` row (what a tracker would receive)."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict]] = []

    @property
    def tracker(self) -> list:
        return self.rows

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.rows.append((step, dict(values)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps to reach")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--mode", choices=["optimizer", "raw-optimizer", "manual"], default="optimizer")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--save-dir")
    parser.add_argument("--load-dir")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    tracker = RecordingTracker()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.grad_accum, log_with=[tracker])
    accelerator.init_trackers("accelerate_app")
    model = models.tiny_mlp(seed=0)
    if args.compile:
        model = torch.compile(model, backend="eager")  # names gain `_orig_mod.`
    raw_optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, raw_optimizer)
    given = {"optimizer": optimizer, "raw-optimizer": raw_optimizer, "manual": None}[args.mode]
    hparams = {"weight_sync": {"servers": [args.server], "every_n_train_steps": args.every, "timeout_s": 30}}
    hook = WeightSyncHook(accelerator, model, given, hparams=hparams)
    if args.load_dir:
        accelerator.load_state(args.load_dir)
    g = torch.Generator().manual_seed(100 + accelerator.process_index)
    with hook:
        while hook.global_step < args.steps:
            with accelerator.accumulate(model):
                loss = model(torch.randn(8, 64, generator=g)).pow(2).mean()
                accelerator.backward(loss)
                optimizer.step()
                if args.mode == "manual":
                    hook.step()
                optimizer.zero_grad()
    if args.save_dir:
        accelerator.save_state(args.save_dir)
    sums = module_checksums(accelerator.unwrap_model(model))
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps({
            "num_processes": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type),
            "state": hook.state_dict(),
            "logged": tracker.rows,
            "checksums": {checkpoint_name(n): v for n, v in sums.items()},
        }))  # fmt: skip
    accelerator.end_training()


if __name__ == "__main__":
    main()
