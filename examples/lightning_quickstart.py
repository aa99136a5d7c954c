"""Quickstart: train with Lightning, serve the new weights every N steps.

A tiny causal LM learns to reverse four letters ("c a f b |" -> "b f a c") on
the CPU. ``WeightSyncCallback`` pushes its weights to an inference server every
``--sync-every`` optimizer steps; after each sync the script asks the *server*
for greedy answers on held-out prompts, so you watch the served model improve
as the versions arrive.

    .venv/bin/python examples/lightning_quickstart.py                    # embedded reference receiver
    .venv/bin/python examples/lightning_quickstart.py --server URL       # a vLLM server (see README)

With no ``--server`` the script starts the reference receiver in-process,
serving a fresh (differently initialized) copy of the model, and ends by
checking the receiver's sha256 checksums against the trainer's weights.
"""

from __future__ import annotations

import argparse
import random

import lightning.pytorch as pl
import requests
import torch
from torch.utils.data import DataLoader, IterableDataset

from wt_callbacks.checksums import module_checksums
from wt_callbacks.demos import toy_task
from wt_callbacks.integrations.lightning import WeightSyncCallback


class ReversalBatches(IterableDataset):
    """An endless stream of training batches (seeded)."""

    def __init__(self, tokenizer, batch_size: int, seed: int = 0) -> None:
        self.tokenizer, self.batch_size, self.seed = tokenizer, batch_size, seed

    def __iter__(self):
        rng = random.Random(self.seed)
        while True:
            yield toy_task.training_batch(self.tokenizer, rng, self.batch_size)


class ReversalLM(pl.LightningModule):
    """The trained policy: ``self.model`` holds the Hugging Face causal LM, so
    ``module: model`` sends the checkpoint's own names (``model.layers.0...``)."""

    def __init__(self, weight_sync: dict, lr: float = 2e-3, batch_size: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tokenizer = toy_task.build_tokenizer()
        self.model = toy_task.build_model(self.tokenizer, seed=0)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def train_dataloader(self):
        return DataLoader(ReversalBatches(self.tokenizer, self.hparams.batch_size), batch_size=None)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class ShowServedAnswers(pl.Callback):
    """After each sync, asks the server for greedy answers on held-out prompts."""

    def __init__(self, sync: WeightSyncCallback, url: str) -> None:
        self.sync, self.url = sync, url
        self.pairs = toy_task.held_out_prompts(8)
        self.seen = 0
        self.model_name = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]

    def answers(self) -> list[str]:
        response = requests.post(
            f"{self.url}/v1/completions",
            json={"model": self.model_name, "prompt": [p for p, _ in self.pairs], "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        response.raise_for_status()
        return [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]

    def _show(self, trainer: pl.Trainer) -> None:
        ws = self.sync.weight_sync
        if ws is None or ws.syncs_completed == self.seen or not trainer.is_global_zero:
            return
        self.seen = ws.syncs_completed
        r = ws.last_result  # the callback already printed its seconds, MB and GB/s
        answers = self.answers()
        print(
            f"  served {r.version:>9} solves {toy_task.accuracy(answers, self.pairs):4.0%} of held-out "
            f"prompts, e.g. '{self.pairs[0][0]}' -> '{answers[0].strip()}'",
            flush=True,
        )

    # After WeightSyncCallback in the callback list, so its round is done.
    def on_train_start(self, trainer, pl_module):
        self._show(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._show(trainer)

    def on_train_end(self, trainer, pl_module):
        self._show(trainer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", help="base URL of a vLLM server; default: start the embedded receiver")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=25)
    parser.add_argument("--dtype", default=None, help="wire dtype, e.g. bfloat16 (default: float32)")
    args = parser.parse_args()
    torch.manual_seed(0)

    receiver = None
    url = args.server
    if url is None:
        # Another seed: the served copy starts out different from the trainer's.
        receiver = toy_task.embedded_receiver()
        url = receiver.url
        print(f"embedded reference receiver serving on {url}")

    module = ReversalLM(
        weight_sync={
            "servers": [url],
            "every_n_train_steps": args.sync_every,
            "module": "model",
            "dtype": args.dtype,
            "timeout_s": 120,
        }
    )
    sync = WeightSyncCallback()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        callbacks=[sync, ShowServedAnswers(sync, url)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(module)
        if receiver is not None:
            via = getattr(torch, args.dtype) if args.dtype else None
            same = module_checksums(receiver.model) == module_checksums(module.model, via_dtype=via)
            print(f"receiver checksums equal the trainer's weights: {same}")
            if not same:
                raise SystemExit(1)
    finally:
        if receiver is not None:
            receiver.stop()


if __name__ == "__main__":
    main()
