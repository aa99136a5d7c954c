"""Overhead of WeightSyncCallback on training steps that do not sync.

Runs the same Lightning fit with and without the callback, alternating, in one
process, and compares the median step time. The callback is connected to a
reference receiver (so its engine and group are live) but its cadence never
comes due during the measured steps: what remains is the per-step cost of the
cadence check itself.

    python benchmarks/callback_overhead.py [--steps 300] [--repeats 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from wt_callbacks.integrations.lightning import WeightSyncCallback
from wt_callbacks.receiver import Receiver

WARMUP_STEPS = 20


def build_model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(512, 512), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(512, 1))


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = build_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepTimer(pl.Callback):
    """Wall time between consecutive batch ends: one full training step."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.stamps.append(time.perf_counter())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])][WARMUP_STEPS:]


class TimedWeightSyncCallback(WeightSyncCallback):
    """Records how long the per-step hook itself takes: immune to the noise
    of other processes that blurs the step-time comparison."""

    hook_seconds: list[float]

    def on_train_batch_end(self, *args, **kwargs) -> None:
        start = time.perf_counter()
        super().on_train_batch_end(*args, **kwargs)
        self.hook_seconds.append(time.perf_counter() - start)


def fit_once(steps: int, url: str | None, hook_seconds: list[float]) -> list[float]:
    """One fit; with ``url`` the callback is attached (cadence never due)."""
    data = TensorDataset(torch.randn(256 * 8, 512), torch.randn(256 * 8, 1))
    timer = StepTimer()
    callbacks: list[pl.Callback] = [timer]
    if url is not None:
        callback = TimedWeightSyncCallback(
            servers=[url],
            module="model",
            every_n_train_steps=10**9,
            sync_on_fit_start=False,
            sync_on_train_end=False,
        )
        callback.hook_seconds = hook_seconds
        callbacks.insert(0, callback)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=256, shuffle=True))
    return timer.step_times()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = parser.parse_args()

    with Receiver(build_model()) as receiver:
        url = receiver.start()
        without, with_cb, hook_seconds = [], [], []
        for _ in range(args.repeats):  # alternate, so drifts hit both arms alike
            without.append(statistics.median(fit_once(args.steps, None, hook_seconds)))
            with_cb.append(statistics.median(fit_once(args.steps, url, hook_seconds)))
    base, cb = statistics.median(without), statistics.median(with_cb)
    hook = statistics.median(hook_seconds)
    result = {
        "steps_per_fit": args.steps,
        "repeats": args.repeats,
        "median_step_s_without": base,
        "median_step_s_with": cb,
        "overhead_ratio": cb / base - 1.0,
        "median_hook_s": hook,
        "hook_ratio": hook / base,
        "per_repeat_without": without,
        "per_repeat_with": with_cb,
    }
    print("| measure | value |\n|---|---|")
    print(f"| median step without callback | {base * 1e3:.3f} ms |")
    print(f"| median step with callback (no sync due) | {cb * 1e3:.3f} ms |")
    print(f"| step-time ratio - 1 | {result['overhead_ratio']:+.2%} |")
    print(f"| median time inside the callback's per-step hook | {hook * 1e6:.1f} us ({result['hook_ratio']:.4%} of a step) |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
