"""A small ``accelerate launch`` training loop with WeightSyncHook, used by the tests
(``accelerate launch ... -m tests.support.accelerate_app``, from the repository root).

Under ``accelerate launch --use_deepspeed`` it runs Accelerate's DeepSpeed path
(which works on a CPU), under ``--use_fsdp`` Accelerate's FSDP plugin (GPU
only); with ``--fsdp1`` it wraps the model in FSDP1 itself, as that plugin
would, for a CPU-only machine, and prepares only the optimizer. Rank 0 writes what the tests check
to ``--out``: the number of processes, the hook's counters, the trainer's full
weights' checksums under checkpoint names, and the peak extra memory of the
``--measure-rounds`` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.tracking import GeneralTracker

from wt_callbacks.demos import models
from wt_callbacks.demos.full_weights import full_checksums
from wt_callbacks.demos.memory import peak_extra_rss


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
    parser.add_argument("--model", choices=["tiny_mlp", "wide_mlp"], default="tiny_mlp")
    parser.add_argument("--fsdp1", choices=["flat", "orig"], help="wrap in FSDP1 (use_orig_params False / True)")
    parser.add_argument("--dtype", help="wire dtype")
    parser.add_argument("--bucket", type=int, help="packed_buffer_size_bytes")
    parser.add_argument("--transport", help="torch_dist transport (default: auto)")
    parser.add_argument("--measure-rounds", type=int, default=0, help="extra rounds measuring peak extra RSS")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--save-dir")
    parser.add_argument("--load-dir")
    parser.add_argument("--send", choices=("blocking", "async"), default="blocking")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    # Set by `accelerate launch --use_deepspeed / --use_fsdp`.
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
    fsdp_plugin = os.environ.get("ACCELERATE_USE_FSDP") == "true"
    if deepspeed and not torch.cuda.is_available():
        from wt_callbacks.demos.deepspeed_cpu import skip_shm_comm_op

        skip_shm_comm_op()
    from accelerate import Accelerator

    from wt_callbacks.integrations.accelerate import WeightSyncHook

    tracker = RecordingTracker()
    # cpu=True would silently drop DeepSpeed and FSDP; they pick their device themselves.
    accelerator = Accelerator(
        cpu=not (deepspeed or fsdp_plugin), gradient_accumulation_steps=args.grad_accum, log_with=[tracker]
    )
    accelerator.init_trackers("accelerate_app")
    model = getattr(models, args.model)(seed=0)
    width = model.layers[0].in_features
    if args.compile:
        model = torch.compile(model, backend="eager")  # names gain `_orig_mod.`
    if args.fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
            device_id=torch.device("cpu"),
            use_orig_params=args.fsdp1 == "orig",
        )
        raw_optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        optimizer = accelerator.prepare(raw_optimizer)
    else:
        raw_optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = accelerator.prepare(model, raw_optimizer)
    given = {"optimizer": optimizer, "raw-optimizer": raw_optimizer, "manual": None}[args.mode]
    section = {"servers": [args.server], "every_n_train_steps": args.every, "timeout_s": 30, "send": args.send}
    if args.dtype:
        section["dtype"] = args.dtype
    section["config"] = {}
    if args.bucket:
        section["config"]["packed_buffer_size_bytes"] = args.bucket
    if args.transport:
        section["config"]["transport"] = args.transport
    hook = WeightSyncHook(accelerator, model, given, hparams={"weight_sync": section})
    if args.load_dir:
        accelerator.load_state(args.load_dir)
    rank = hook.weight_sync.rank
    g = torch.Generator().manual_seed(100 + rank)
    measured = []
    scheme = hook.weight_sync.source.scheme
    with hook:
        while hook.global_step < args.steps:
            with accelerator.accumulate(model):
                loss = model(torch.randn(8, width, generator=g).to(accelerator.device)).pow(2).mean()
                accelerator.backward(loss)
                optimizer.step()
                if args.mode == "manual":
                    hook.step()
                optimizer.zero_grad()
        for i in range(args.measure_rounds):
            with peak_extra_rss() as rss:
                hook.sync_now(f"measure-{i + 1}")
            measured.append(rss.extra)
    if args.save_dir:
        accelerator.save_state(args.save_dir)
    sums = full_checksums(model, via_dtype=getattr(torch, args.dtype) if args.dtype else None)
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "num_processes": hook.weight_sync.world_size,
            "accelerate_num_processes": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type),
            "scheme": scheme,
            "state": hook.state_dict(),
            "logged": tracker.rows,
            "checksums": sums,
            "measured_rss": measured,
        }))  # fmt: skip
    if dist.is_initialized():
        dist.barrier()
    accelerator.end_training()


if __name__ == "__main__":
    main()
