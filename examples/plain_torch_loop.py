"""A hand-written PyTorch loop that pushes its weights to a server every N steps.

Uses the weight-transfer API directly (no Lightning, no Accelerate): build a
``ModuleSource``, create the trainer engine through
``WeightTransferTrainerFactory`` and call ``send_weights()`` on cadence.

    .venv/bin/python examples/plain_torch_loop.py                 # embedded reference receiver
    .venv/bin/python examples/plain_torch_loop.py --server URL    # any server speaking vLLM's RL routes

With no ``--server`` it starts the reference receiver in this process, hosting a
fresh copy of the model, and checks at the end that the receiver holds exactly
the trainer's weights.
"""

from __future__ import annotations

import argparse
import copy
import contextlib

import torch
from torch import nn

from wt_callbacks.checksums import module_checksums
from wt_callbacks.transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", help="base URL of a server; default: start the embedded receiver")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--dtype", default=None, help="wire dtype, e.g. bfloat16")
    args = parser.parse_args()

    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    target = torch.randn(16, 1)

    with contextlib.ExitStack() as stack:
        receiver = None
        url = args.server
        if url is None:
            from wt_callbacks.receiver import Receiver

            receiver = stack.enter_context(Receiver(copy.deepcopy(model)))
            url = receiver.start()
            print(f"embedded reference receiver on {url}")
        client = HTTPVLLMWeightSyncClient(url, timeout=120)
        engine = WeightTransferTrainerFactory.trainer_init(
            "torch_dist",
            {"dtype": args.dtype, "timeout_s": 120},
            {"master_address": "127.0.0.1", "master_port": 0, "rank": 0},
            client=client,
            source=ModuleSource(model),
        )
        stack.callback(engine.shutdown)

        for step in range(1, args.steps + 1):
            x = torch.randn(64, 16)
            loss = nn.functional.mse_loss(model(x), x @ target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % args.sync_every == 0 or step == args.steps:
                engine.send_weights(f"step-{step}")
                s = engine.last_stats
                print(
                    f"step {step:4d}  loss {loss.item():.4f}  synced step-{step}: {s.seconds:.3f} s, "
                    f"{s.bytes / 1e6:.1f} MB, {s.bytes / s.seconds / 1e9:.2f} GB/s"
                )
        print("server versions:", client.weight_info()[0].get("version_history"))
        if receiver is not None:
            via = getattr(torch, args.dtype) if args.dtype else None
            same = module_checksums(receiver.model) == module_checksums(model, via_dtype=via)
            print(f"receiver checksums equal the trainer's: {same}")
            if not same:
                raise SystemExit(1)


if __name__ == "__main__":
    main()
