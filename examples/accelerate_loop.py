"""A hand-written ``accelerate launch`` loop whose weights a server keeps serving.

The tiny causal LM of the quickstart learns to reverse four letters, with
gradient accumulation; ``WeightSyncHook`` counts real optimizer steps and
pushes the weights every ``every_n_train_steps`` of them, configured by
``examples/weight_sync.yaml``:

    .venv/bin/accelerate launch --config_file examples/accelerate_config.yaml examples/accelerate_loop.py
    .venv/bin/python examples/accelerate_loop.py --server URL        # one process, a vLLM server

With no ``--server`` the main process starts the embedded reference receiver
and the run ends by checking its checksums against the trained weights.
"""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path

import requests
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from wt_callbacks.checksums import module_checksums
from wt_callbacks.demos import toy_task
from wt_callbacks.integrations.accelerate import WeightSyncHook

HERE = Path(__file__).resolve().parent


def served_accuracy(url: str, pairs: list[tuple[str, str]]) -> tuple[float, str]:
    """Greedy answers of the *server* on held-out prompts."""
    name = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    response = requests.post(
        f"{url}/v1/completions",
        json={"model": name, "prompt": [p for p, _ in pairs], "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    response.raise_for_status()
    answers = [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]
    return toy_task.accuracy(answers, pairs), answers[0].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", help="base URL of a vLLM server; default: the embedded receiver")
    parser.add_argument("--config", default=str(HERE / "weight_sync.yaml"), help="YAML with a weight_sync section")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "urllib3", "wt_callbacks.sync", "wt_callbacks.transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    # cpu=True: with `accelerate launch --multi_gpu` this gives real MULTI_CPU
    # (gloo) processes on a machine without GPUs.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.grad_accum)
    tokenizer = toy_task.build_tokenizer()
    model = toy_task.build_model(tokenizer, seed=0)

    receiver = None
    url = args.server
    if url is None and accelerator.is_main_process:
        receiver = toy_task.embedded_receiver()
        url = receiver.url
        accelerator.print(f"embedded reference receiver serving on {url}")
    url = broadcast_object_list([url])[0]

    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    pairs = toy_task.held_out_prompts(8)
    rng = random.Random(accelerator.process_index)
    shown = 0
    try:
        with WeightSyncHook(accelerator, model, optimizer, hparams=args.config, servers=[url]) as hook:
            while hook.global_step < args.steps:
                batch = toy_task.training_batch(tokenizer, rng, args.batch_size)
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    optimizer.step()  # the hook syncs after every N real steps
                    optimizer.zero_grad()
                if accelerator.is_main_process and hook.weight_sync.syncs_completed != shown:
                    shown = hook.weight_sync.syncs_completed
                    accuracy, example = served_accuracy(url, pairs)
                    version = hook.weight_sync.last_result.version
                    print(f"  served {version:>9} solves {accuracy:4.0%} of held-out prompts "
                          f"('{pairs[0][0]}' -> '{example}')", flush=True)  # fmt: skip
        if receiver is not None:
            same = module_checksums(receiver.model) == module_checksums(accelerator.unwrap_model(model))
            print(f"versions served: {receiver.core.version_history}")
            print(f"receiver checksums equal the trainer's weights: {same}", flush=True)
            if not same:
                raise SystemExit(1)
    finally:
        accelerator.wait_for_everyone()
        if receiver is not None:
            receiver.stop()
        accelerator.end_training()


if __name__ == "__main__":
    main()
