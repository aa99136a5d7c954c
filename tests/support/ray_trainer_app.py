"""A trainer process driving vLLM engines in Ray actors by name, used by tests/test_vllm_ray.py.

It joins the cluster as a driver (its environment carries the cluster's
token: Ray reads it once per process, which is why this is a process of its
own), syncs ``WeightSync(SyncConfig(ray_actors=...))`` for two rounds, then
one more round from a second session with ``commit: prepared`` (the engines
receive and process it while they stay usable, and commit it at finish),
and prints what it saw as one JSON line: where the actors run as the client
sees them, what the trainer advertised, the transport, and each engine's max
|logprob difference| to the trainer's model before and after each round.

    python -m tests.support.ray_trainer_app --address HOST:PORT --node-ip-address IP \\
        --namespace NS --model DIR --name vllm-0 --name vllm-1
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import ray
import torch

from wt_callbacks.config import SyncConfig
from wt_callbacks.demos import toy_task
from wt_callbacks.demos.vllm_ray import max_logprob_diff
from wt_callbacks.sync import WeightSync


def new_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights no engine holds yet."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--node-ip-address", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--name", action="append", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from transformers import LlamaForCausalLM

    ray.init(address=args.address, _node_ip_address=args.node_ip_address, log_to_driver=False)
    tokenizer = toy_task.build_tokenizer()
    prompts = [tokenizer(prompt)["input_ids"] for prompt, _ in toy_task.held_out_prompts(4)]
    handles = [ray.get_actor(name, namespace=args.namespace) for name in args.name]
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    new_weights(model, seed=1)
    config = SyncConfig(ray_actors=args.name, ray_namespace=args.namespace, pause="none", timeout_s=120)
    sync = WeightSync(config)
    sync.setup(model)
    try:
        report = {
            "server_hosts": sync.client.server_hosts(),
            "master_address": sync.engine.worker_init_info["master_address"],
            "transport": sync.engine.group.transport,
            "before": [max_logprob_diff(h, model, prompts) for h in handles],
            "rounds": [],
        }
        for step in range(1, args.rounds + 1):
            new_weights(model, seed=1 + step)
            if not sync.maybe_sync(step):
                raise RuntimeError(f"round {step} did not run")
            report["rounds"].append([max_logprob_diff(h, model, prompts) for h in handles])
    finally:
        sync.close()
    prepared = WeightSync(dataclasses.replace(config, commit="prepared"))
    prepared.setup(model)
    try:
        new_weights(model, seed=2 + args.rounds)
        if not prepared.maybe_sync(args.rounds + 1):
            raise RuntimeError("the prepared round did not run")
        report["prepared_round"] = [max_logprob_diff(h, model, prompts) for h in handles]
    finally:
        prepared.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
