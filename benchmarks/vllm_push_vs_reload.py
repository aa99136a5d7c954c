"""Seconds per weight sync into a real vLLM server: our push vs reload-from-disk.

Run from the repository root with the project venv, after
``bash scripts/vllm_env.sh`` (which prints the vLLM venv's python)::

    WT_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/vllm_push_vs_reload.py \\
        --out benchmarks/results/vllm_push_vs_reload.json --md benchmarks/results/vllm_push_vs_reload.md

For each model size (``toy``: the toy task's 2-layer Llama; ``llama-74M`` and
``llama-296M``: Llamas built offline from a ``LlamaConfig``, hidden 512 / 1024,
12 / 18 layers, vocab 32000) it starts a vLLM server (fp32, our
``torch_dist`` plugin) on a checkpoint the trainer also loads. Then, for one
warm-up round and ``--rounds`` timed rounds, it changes the trainer's weights
before each sync and syncs them into the server by:

* **push**, for each ``--push-configs`` entry in turn (default: the shipped
  defaults and ``packed=False``): one ``trainer_init`` (timed apart), then
  the timed ``engine.send_weights()`` of every round on that engine (start,
  update over the configured transport, finish, all through vLLM's RL
  routes), as a trainer does. The server call times of start / update /
  finish are recorded too, and from the server's log the worker's own view
  of the update: the seconds it spent receiving (handing each tensor to
  vLLM's loader as it arrives) and how much of that it waited for the
  trainer's data, then the seconds it took to apply the update (vLLM's
  processing of every layer, which a reload does too, and which our
  plugin runs once the whole update has arrived).
* **reload**, what a user of vLLM 0.32 would do otherwise: ``save_pretrained``
  (safetensors) into a directory, then ``POST /collective_rpc {"method":
  "reload_weights", "kwargs": {"weights_path": DIR}}``. Timed as save + RPC.
  A reload round follows every push round (new weights again), so both see
  the same load on a shared machine; the RPC alone is what a push must beat
  once the checkpoint is written.

Neither pauses generation (the server is idle). The reload reads a file this
machine just wrote, so it comes from the page cache: across machines it would
also need a shared filesystem. After the last round of each path the server's
greedy logprobs are compared with the trainer model's (transformers), so each
path is known to deliver the weights. The average CPU cores used by other
processes during the rounds is reported: on a shared machine timings are
comparable only when it is near 0.

Output: JSON (``--out``) and a markdown table (stdout, and ``--md``). The ratios
are median reload seconds / median push seconds (> 1: the push is faster), and
median push seconds / median reload RPC seconds of the rounds interleaved with
that push config (< 1: the push beats even a reload of a written checkpoint).
Needs ``WT_VLLM_PYTHON`` (exit status 2 without it); exit status 1 when a
path's logprobs differ by more than ``LOGPROB_TOLERANCE``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
import torch

from wt_callbacks.demos import toy_task
from wt_callbacks.demos.vllm_server import find_vllm_python, max_logprob_diff, start_vllm_server
from wt_callbacks.transfer import ModuleSource

from harness import CpuLoadMeter, TimedClient, server_pids, trainer_engine

SIZES = ("toy", "llama-74M", "llama-296M")
LLAMA_SHAPES = {
    "llama-74M": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 12, "num_attention_heads": 8},
    "llama-296M": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 18, "num_attention_heads": 16},
}
"""Llamas built offline (vocab 32000, head_dim 64, untied embeddings)."""
PROMPT_WORDS = "a b c d |"
LOGPROB_TOLERANCE = 1e-3
"""Max |logprob difference| between the server and the trainer's model after a
path's last round (measured: ~1e-6 in fp32); beyond it the path did not
deliver the weights and the exit status is 1."""
DEFAULT_PUSH_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "default-gloo": {"transport": "gloo"},
    "unpacked": {"packed": False},
}
"""The shipped defaults (packed, 64 MiB chunks; ``auto`` picks the shm ring
for a server on this host), the same over loopback TCP (what a server on
another host gets, minus the network), and one collective per tensor."""


def build_model_dir(size: str, directory: Path) -> Path:
    """Write a model vLLM can serve; every size uses the toy tokenizer (offline)."""
    if size == "toy":
        return toy_task.save_pretrained(directory)
    if size not in LLAMA_SHAPES:
        raise ValueError(f"--sizes: unknown size {size!r}; choose from {SIZES}")
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = toy_task.build_tokenizer()
    torch.manual_seed(0)
    shape = LLAMA_SHAPES[size]
    config = LlamaConfig(
        vocab_size=32000,
        **shape,
        num_key_value_heads=shape["num_attention_heads"],
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> None:
    """New weights each round, deterministically, so no sync is a no-op."""
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=generator) * 0.01)


WORKER_LINE = re.compile(
    r"wt_callbacks update_weights: \d+ tensors, [\d.]+ MB received in ([\d.]+) s "
    r"\(([\d.]+) s of it waiting for the trainer's data\), applied in ([\d.]+) s"
)
"""The line our vLLM worker engine logs after every update (``integrations/vllm.py``)."""


def worker_seconds(log: Path, offset: int) -> tuple[int, dict[str, float] | None]:
    """The worker's ``received`` / ``waiting`` / ``applied`` seconds of the
    last update logged after byte ``offset`` of the server log, and the new
    offset."""
    with open(log, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    found = WORKER_LINE.findall(text)
    stats = (
        {"receive_s": float(found[-1][0]), "waiting_s": float(found[-1][1]), "apply_s": float(found[-1][2])}
        if found else None
    )  # fmt: skip
    return offset + len(text.encode()), stats


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "all": values}


def bench_size(
    size: str, python: Path, workdir: Path, rounds: int, timeout_s: float, push_configs: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """One server; per round: each push config (its own engine), then a reload."""
    from transformers import LlamaForCausalLM

    model_dir = build_model_dir(size, workdir / size / "model")
    reload_dir = workdir / size / "reload"
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = toy_task.build_tokenizer()(PROMPT_WORDS)["input_ids"]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{size}] {n_params / 1e6:.1f}M parameters; starting vLLM ...", flush=True)
    server = start_vllm_server(python, model_dir, workdir / size / "vllm.log", timeout_s=timeout_s)
    print(f"[{size}] server log: {server.log_path}", flush=True)
    session = requests.Session()
    client = TimedClient(server.url, timeout=timeout_s)

    def init(config: dict[str, Any]) -> tuple[Any, float]:
        start = time.perf_counter()
        engine = trainer_engine(client, ModuleSource(model), timeout_s, config)
        return engine, time.perf_counter() - start

    def reload() -> tuple[float, float]:
        save_s = timed(lambda: model.save_pretrained(reload_dir))
        answer: list[requests.Response] = []
        rpc_s = timed(
            lambda: answer.append(
                session.post(
                    f"{server.url}/collective_rpc",
                    json={"method": "reload_weights", "kwargs": {"weights_path": str(reload_dir)}},
                    timeout=timeout_s,
                )
            )
        )
        answer[0].raise_for_status()
        return save_s, rpc_s

    pushes: dict[str, dict[str, Any]] = {name: {"send": [], "calls": [], "rpc": [], "worker": []} for name in push_configs}
    log_offset = 0
    save_s: list[float] = []
    rpc_s: list[float] = []
    diffs: dict[str, float] = {}
    seed = 0
    try:
        with CpuLoadMeter(*server_pids(server)) as load:
            # One engine per config for all its rounds, as a trainer keeps
            # one: its buffers and the server's are reused from round to
            # round. The server holds one group at a time, so the configs
            # take turns rather than alternating every round; a reload round
            # follows every push round, so a change of load on a shared
            # machine hits both alike (the group stays idle meanwhile).
            for name, config in push_configs.items():
                engine, pushes[name]["init"] = init(config)
                try:
                    for r in range(rounds + 1):  # round 0 warms up
                        seed += 1
                        perturb(model, seed)
                        start = time.perf_counter()
                        engine.send_weights(f"{name}-{r}")
                        send = time.perf_counter() - start
                        log_offset, worker = worker_seconds(server.log_path, log_offset)
                        seed += 1
                        perturb(model, seed)
                        t_save, t_rpc = reload()
                        if r:
                            pushes[name]["send"].append(send)
                            pushes[name]["calls"].append(dict(client.call_seconds))
                            pushes[name]["rpc"].append(t_rpc)
                            if worker is not None:
                                pushes[name]["worker"].append(worker)
                            save_s.append(t_save)
                            rpc_s.append(t_rpc)
                        print(
                            f"[{size}] push[{name}] round {r}{'' if r else ' (warm-up)'}: {send:.3f} s; "
                            f"reload: save {t_save:.3f} + rpc {t_rpc:.3f} s",
                            flush=True,
                        )
                    # The last round was a reload: push once more so the check sees this path's weights.
                    seed += 1
                    perturb(model, seed)
                    engine.send_weights(f"{name}-check")
                    diffs[name] = max_logprob_diff(server, model, [prompt])
                finally:
                    engine.shutdown()
            seed += 1
            perturb(model, seed)
            reload()
            diffs["reload"] = max_logprob_diff(server, model, [prompt])
    finally:
        client.close()
        session.close()
        server.stop()
    reload_s = [a + b for a, b in zip(save_s, rpc_s)]
    return {
        "size": size,
        "params": n_params,
        "fp32_bytes": n_params * 4,
        "tensors": len(list(model.parameters())),
        "pushes": {
            name: {
                "config": push_configs[name],
                "send_s": summary(p["send"]),
                "trainer_init_s": p["init"],
                "call_s": {k: statistics.median(c[k] for c in p["calls"]) for k in p["calls"][0]},
                # The worker's side (from its log line; None if the server logged none).
                "worker_s": {k: statistics.median(w[k] for w in p["worker"]) for k in p["worker"][0]} if p["worker"] else None,
                "ratio_reload_over_push": statistics.median(reload_s) / statistics.median(p["send"]),
                "reload_rpc_s": summary(p["rpc"]),
                # The target: the push against the reload RPC alone (checkpoint already written), rounds interleaved.
                "ratio_push_over_reload_rpc": statistics.median(p["send"]) / statistics.median(p["rpc"]),
                "max_logprob_diff": diffs[name],
            }
            for name, p in pushes.items()
        },
        "reload": {
            "total_s": summary(reload_s),
            "save_s": summary(save_s),
            "rpc_s": summary(rpc_s),
            "max_logprob_diff": diffs["reload"],
        },
        "other_cpu_cores": load.other_cores,
    }


def worker_cell(worker: dict[str, float] | None) -> str:
    return "-" if worker is None else f"{worker['receive_s']:.3f} ({worker['waiting_s']:.3f}) + {worker['apply_s']:.3f}"


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | params | push config | push s (median / min) | push: start + update + finish s "
        "| worker: receive s (waiting for data s) + apply s "
        "| reload s (median / min) | reload: save + rpc s | reload / push "
        "| reload rpc s, interleaved (median) | push / reload rpc "
        "| logprob diff push / reload | other load (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        reload = r["reload"]
        for name, p in r["pushes"].items():
            calls = p["call_s"]
            lines.append(
                f"| {r['size']} | {r['params'] / 1e6:.1f}M | {name} "
                f"| {p['send_s']['median']:.3f} / {p['send_s']['min']:.3f} "
                f"| {calls['start_weight_update']:.3f} + {calls['update_weights']:.3f} "
                f"+ {calls['finish_weight_update']:.3f} "
                f"| {worker_cell(p['worker_s'])} "
                f"| {reload['total_s']['median']:.3f} / {reload['total_s']['min']:.3f} "
                f"| {reload['save_s']['median']:.3f} + {reload['rpc_s']['median']:.3f} "
                f"| {p['ratio_reload_over_push']:.2f}x "
                f"| {p['reload_rpc_s']['median']:.3f} | {p['ratio_push_over_reload_rpc']:.2f} "
                f"| {p['max_logprob_diff']:.1g} / {reload['max_logprob_diff']:.1g} "
                f"| {r['other_cpu_cores']:.2f} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {SIZES}")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per size (after 1 warm-up)")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound in seconds on startup and each call")
    parser.add_argument(
        "--push-configs",
        type=json.loads,
        default=DEFAULT_PUSH_CONFIGS,
        help="JSON object: label -> torch_dist trainer config, each timed as its own push "
        f"(default: {json.dumps(DEFAULT_PUSH_CONFIGS)})",
    )
    parser.add_argument("--out", type=Path, help="JSON output path")
    parser.add_argument("--md", type=Path, help="markdown output path")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    python, reason = find_vllm_python()
    if python is None:
        print(reason, file=sys.stderr)
        return 2
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="wt-vllm-bench-") as tmp:
        results = [
            bench_size(size, python, Path(tmp), args.rounds, args.timeout, args.push_configs) for size in sizes
        ]
    report = {
        "benchmark": "vllm_push_vs_reload",
        "vllm_python": str(Path(python.parent.parent.name, "bin", python.name)),  # its venv, not the machine's path
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "rounds": args.rounds,
        "timeout_s": args.timeout,
        "results": results,
    }
    table = markdown(results)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(
            f"Seconds per weight sync into vLLM (fp32, {args.rounds} rounds after a warm-up; "
            f"{os.cpu_count()} CPUs). See `benchmarks/vllm_push_vs_reload.py`.\n\n{table}\n"
        )
    wrong = [
        f"{r['size']} {name}: {diff:.1g}"
        for r in results
        for name, diff in [*((n, p["max_logprob_diff"]) for n, p in r["pushes"].items()), ("reload", r["reload"]["max_logprob_diff"])]
        if not diff <= LOGPROB_TOLERANCE
    ]
    if wrong:
        print(f"the server's logprobs differ from the trainer's model by more than {LOGPROB_TOLERANCE:g}: {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
