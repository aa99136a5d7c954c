"""vLLM engines in Ray actors: deployed from the vLLM environment, driven by name from a trainer without vLLM.

The split users have: the inference side (vLLM installed) starts vLLM's own
``LLM`` as named, detached Ray actors with the ``torch_dist`` weight-transfer
config (wt-callbacks installed there registers the engine in every vLLM
process); the trainer (no vLLM) lists their names (``ray_actors``) and
drives them with ``RayVLLMWeightSyncClient``.

    <vLLM venv>/bin/python -m wt_callbacks.demos.vllm_ray --address HEAD:PORT \\
        --model DIR --name vllm-0 --name vllm-1 [--namespace NS] [--resources '{"gpu_host": 1}']

Each actor is an independent replica (``LLM``'s ``data_parallel_index`` 0):
vLLM 0.32 runs no data-parallel ranks of a dense model as separate
processes (``LLM(data_parallel_size>1)`` and external data-parallel ranks are
refused), so the trainer gives each its own ``rank_offset``.
``greedy_logprobs`` runs inside such an actor (``__ray_call__``) and returns
plain lists, which a trainer without vLLM can read; ``max_logprob_diff``
compares them with the trainer's model.

pytest-free on purpose, like ``vllm_server``: the README points here.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from wt_callbacks.demos.vllm_server import CPU_ENGINE_ENV, MAX_TOKENS, max_model_len
from wt_callbacks.verify import teacher_forced_logprobs

READY_TIMEOUT_S = 300.0
"""How long a deployment waits for its engines to load (30-60 s each on 2 CPU cores)."""


def deploy(
    model_dir: str,
    names: Sequence[str],
    *,
    namespace: str | None = None,
    resources: Mapping[str, float] | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = READY_TIMEOUT_S,
) -> list[Any]:
    """Start one detached ``LLM`` actor per name on the connected Ray cluster
    and wait until every engine answers; returns their handles.

    ``resources``: custom Ray resources an actor needs (one per actor), to
    place it on the nodes that offer them. ``env``: the engines' environment
    (default ``CPU_ENGINE_ENV``). Detached: they outlive this process, until
    ``ray.kill`` or the cluster's end.
    """
    import ray
    from vllm import LLM

    engine = ray.remote(LLM)
    placement = {
        "namespace": namespace,
        "lifetime": "detached",
        "num_cpus": 0,  # vLLM's engine processes take the cores; the actor itself mostly waits
        "resources": dict(resources or {}),
        "runtime_env": {"env_vars": dict(CPU_ENGINE_ENV if env is None else env)},
    }
    handles = [
        engine.options(name=name, **placement).remote(
            model=model_dir,
            dtype="float32",
            enforce_eager=True,
            max_model_len=max_model_len(model_dir),
            weight_transfer_config={"backend": "torch_dist"},
        )
        for name in names
    ]
    ray.get([h.get_world_size.remote() for h in handles], timeout=timeout_s)
    return handles


def greedy_logprobs(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Inside an ``LLM`` actor (``handle.__ray_call__.remote(fn=greedy_logprobs,
    prompts=..., max_tokens=...)``): the greedy continuation of each prompt,
    token ids and their logprobs, as plain lists."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    answers = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        answers.append((tokens, [float(step[t].logprob) for t, step in zip(tokens, completion.logprobs)]))
    return answers


def max_logprob_diff(
    handle: Any, model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, max_tokens: int = MAX_TOKENS
) -> float:
    """The largest |logprob difference| between the engine in actor ``handle``
    and ``model`` on the engine's greedy continuations of ``prompts``."""
    import ray

    answers = ray.get(
        handle.__ray_call__.remote(fn=greedy_logprobs, prompts=[list(p) for p in prompts], max_tokens=max_tokens),
        timeout=READY_TIMEOUT_S,
    )
    return max(
        abs(served - expected)
        for prompt, (tokens, logprobs) in zip(prompts, answers)
        for served, expected in zip(logprobs, teacher_forced_logprobs(model, prompt, tokens))
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m wt_callbacks.demos.vllm_ray",
        description="Start vLLM engines as named Ray actors that a trainer syncs by name (ray_actors).",
    )
    parser.add_argument("--address", required=True, help="the Ray cluster to join (HEAD:PORT)")
    parser.add_argument("--model", required=True, help="the checkpoint directory every engine serves")
    parser.add_argument("--name", action="append", required=True, help="an actor name; repeat for more replicas")
    parser.add_argument("--namespace", default=None, help="Ray namespace of the actors")
    parser.add_argument("--resources", type=json.loads, default=None, help="custom Ray resources per actor (JSON)")
    parser.add_argument("--node-ip-address", default=None, help="this node's address in the cluster, if not the default")
    args = parser.parse_args(argv)

    import ray

    ray.init(address=args.address, _node_ip_address=args.node_ip_address, log_to_driver=False)
    deploy(args.model, args.name, namespace=args.namespace, resources=args.resources)
    print(f"vLLM engines ready: {', '.join(args.name)}", flush=True)


if __name__ == "__main__":
    main()
