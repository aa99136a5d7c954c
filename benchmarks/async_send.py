"""What ``send: async`` saves the training loop against ``send: blocking``, into a real vLLM server.

Run from the repository root with the project venv, after
``bash scripts/vllm_env.sh`` (which prints the vLLM venv's python)::

    WT_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/async_send.py \\
        --out benchmarks/results/async_send.json --md benchmarks/results/async_send.md

For each ``--sizes`` entry (``llama-74M``, ``llama-296M``: the Llamas of
``vllm_push_vs_reload.py``; ``toy`` for a smoke run) it starts a vLLM server
(fp32, our ``torch_dist`` plugin, ``pause: keep``, ``commit: inline``) on a
checkpoint the trainer also loads, then, in one run:

1. **Stall.** ``--rounds`` rounds per mode, the modes in alternating blocks
   (``--blocks`` of each: blocking, async, blocking, async, ...), each block
   its own ``WeightSync`` (connected and warmed up by its cold sync, not
   timed). A round: change the weights, call ``maybe_sync`` and time the call
   (what the training loop waits for). Under async the loop then waits for
   the round to end (``state_dict`` does) before the next, so a stall is the
   snapshot alone, the previous round never in the way. Ratio: median async
   stall / median blocking round. Also the peak resident memory of this
   process above its level before the block's ``setup`` (the trainer's
   extra memory), next to the snapshot's bytes (every sent tensor, fp32).
2. **Training.** ``--steps`` real training steps (forward, backward and
   ``--optimizer`` on random token batches of ``--batch`` x ``--seq``; SGD by
   default, whose step on these sizes takes about as long as a round here,
   the case the target is for), with a sync after every step: none,
   blocking, async (in that order, one ``WeightSync`` each). Wall time of the steps and of the final sync (until the servers
   hold the last step); ratio async / blocking. Each step's compute is timed
   apart from the hook: inflation = median compute under async / median
   compute without syncing (the background round competes for the cores).
   The target assumes a step about as long as a round: the table shows both.

After each block and each training mode the server's greedy logprobs are
compared with the trainer's model (exit status 1 beyond ``LOGPROB_TOLERANCE``:
a round did not deliver). ``--server URL --model-dir DIR`` runs against a
server that is already up, serving ``DIR`` (its weights are overwritten).
``--split-cores`` runs the trainer on the first half of the CPUs and the
server (its processes, and vLLM's OpenMP threads) on the other half, as a
trainer and a server on machines of their own would; by default both share
every core, and a background round then competes with the training step
for them. ``--phases`` runs one table alone. The weights are written once before
anything is measured, so the checkpoint's pages the model was loaded from
(copy-on-write) do not count as the trainer's extra memory. The CPU cores
other processes used meanwhile are reported: on a shared machine the
ratios mean something only when that is near 0.
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

from wt_callbacks.config import SyncConfig
from wt_callbacks.demos import toy_task
from wt_callbacks.demos.vllm_server import find_vllm_python, start_vllm_server
from wt_callbacks.sync import WeightSync
from wt_callbacks.transfer import ModuleSource
from wt_callbacks.verify import ProbeSet, served_logprob_diff

from harness import CpuLoadMeter, RssSampler, server_pids
from vllm_push_vs_reload import LOGPROB_TOLERANCE, PROMPT_WORDS, SIZES, build_model_dir

MB = 1e6


def scaled(model: torch.nn.Module) -> None:
    """New weights, in place (no temporary to blur the memory measured): 2% larger."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.02)


class Target:
    """The server a size is measured on, and how to check what it serves."""

    def __init__(self, url: str, api_key: str | None, pids: list[int]) -> None:
        self.url, self.api_key, self.pids = url, api_key, pids
        self.probes = ProbeSet((tuple(toy_task.build_tokenizer()(PROMPT_WORDS)["input_ids"]),), 4)

    def config(self, send: str, timeout_s: float) -> SyncConfig:
        return SyncConfig(servers=[self.url], api_key=self.api_key, send=send, timeout_s=timeout_s, every_n_train_steps=1)

    def diff(self, model: torch.nn.Module) -> float:
        return served_logprob_diff(model, self.url, api_key=self.api_key, probes=self.probes, timeout_s=120)[self.url]


def stall_phase(target: Target, model: torch.nn.Module, rounds: int, blocks: int, timeout_s: float) -> dict[str, Any]:
    stalls: dict[str, list[float]] = {"blocking": [], "async": []}
    snapshot_s: list[float] = []
    latency_s: list[float] = []
    rss_extra: dict[str, list[int]] = {"blocking": [], "async": []}
    diffs: list[float] = []
    step = 0
    for block in range(blocks):
        for send in ("blocking", "async"):
            with RssSampler() as rss:
                ws = WeightSync(target.config(send, timeout_s))
                ws.setup(model)
                try:
                    assert ws.sync_at_fit_start(step) is not None, "the cold sync failed"
                    collected = []
                    for _ in range(rounds):
                        step += 1
                        scaled(model)
                        start = time.perf_counter()
                        if ws.maybe_sync(step):
                            collected.append(ws.last_result)  # under async: the round before
                        stalls[send].append(time.perf_counter() - start)
                        ws.state_dict()  # under async: the round ends before the next, off the clock
                    collected.append(ws.sync_at_train_end(step))
                    if send == "async":
                        snapshot_s += [r.snapshot_seconds for r in collected if r is not None]
                        latency_s += [r.latency_seconds for r in collected if r is not None]
                finally:
                    ws.close()
            rss_extra[send].append(rss.extra)
            diffs.append(target.diff(model))
            print(
                f"  stall block {block} {send}: median {statistics.median(stalls[send][-rounds:]):.3f} s, "
                f"RSS +{rss.extra / MB:.0f} MB",
                flush=True,
            )
    blocking, async_ = statistics.median(stalls["blocking"]), statistics.median(stalls["async"])
    return {
        "blocking_round_s": blocking,
        "async_stall_s": async_,
        "ratio_async_stall_over_blocking_round": async_ / blocking,
        "stalls_s": stalls,
        "async_snapshot_s": statistics.median(snapshot_s) if snapshot_s else None,
        "async_latency_s": statistics.median(latency_s) if latency_s else None,
        "trainer_rss_extra_bytes": {k: max(v) for k, v in rss_extra.items()},
        "max_logprob_diff": max(diffs),
    }


def training_phase(
    target: Target, model: torch.nn.Module, steps: int, batch: int, seq: int, optimizer_name: str, timeout_s: float
) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if optimizer_name == "adamw" else torch.optim.SGD(model.parameters(), lr=1e-3)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    modes: dict[str, Any] = {}
    step = 10_000  # past the stall phase's steps
    for send in ("none", "blocking", "async"):
        ws = None if send == "none" else WeightSync(target.config(send, timeout_s))
        if ws is not None:
            ws.setup(model)
            assert ws.sync_at_fit_start(step) is not None, "the cold sync failed"
        compute: list[float] = []
        hooks: list[float] = []
        model.train()
        start = time.perf_counter()
        try:
            for _ in range(steps):
                ids = torch.randint(0, vocab, (batch, seq), generator=generator)
                t0 = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                t1 = time.perf_counter()
                step += 1
                if ws is not None:
                    ws.maybe_sync(step)
                compute.append(t1 - t0)
                hooks.append(time.perf_counter() - t1)
            if ws is not None:
                ws.sync_at_train_end(step)  # until the servers hold the last step
            wall = time.perf_counter() - start
        finally:
            model.eval()
            if ws is not None:
                ws.close()
        modes[send] = {
            "wall_s": wall,
            "compute_s_median": statistics.median(compute),
            "hook_s_median": statistics.median(hooks),
            "max_logprob_diff": target.diff(model) if ws is not None else None,
        }
        print(f"  training {send}: {steps} steps in {wall:.2f} s (compute {modes[send]['compute_s_median']:.3f} s/step)", flush=True)
    return {
        "steps": steps,
        "batch": batch,
        "seq": seq,
        "optimizer": optimizer_name,
        "modes": modes,
        "ratio_async_over_blocking_wall": modes["async"]["wall_s"] / modes["blocking"]["wall_s"],
        "compute_inflation_async": modes["async"]["compute_s_median"] / modes["none"]["compute_s_median"],
    }


def bench_size(size: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    server = None
    if args.server:
        model_dir = args.model_dir
        target = Target(args.server, args.api_key, [])
    else:
        python, reason = find_vllm_python()
        if python is None:
            print(reason, file=sys.stderr)
            sys.exit(2)
        model_dir = build_model_dir(size, workdir / size / "model")
        print(f"[{size}] starting vLLM ...", flush=True)
        env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, args.server_cpus))} if args.server_cpus else None
        server = start_vllm_server(python, model_dir, workdir / size / "vllm.log", timeout_s=args.timeout, extra_env=env)
        target = Target(server.url, None, server_pids(server))
        for pid in target.pids if args.server_cpus else ():
            os.sched_setaffinity(pid, args.server_cpus)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scaled(model)  # the loaded pages, copied on this first write, are the model's own from here on
    n_params = sum(p.numel() for p in model.parameters())
    snapshot_bytes = sum(m.nbytes for m in ModuleSource(model).metadata())
    try:
        stall = training = None
        with CpuLoadMeter(*target.pids) as load:
            if "stall" in args.phases:
                print(f"[{size}] {n_params / 1e6:.1f}M parameters: stall", flush=True)
                stall = stall_phase(target, model, args.rounds, args.blocks, args.timeout)
            if "training" in args.phases:
                print(f"[{size}] training", flush=True)
                training = training_phase(target, model, args.steps, args.batch, args.seq, args.optimizer, args.timeout)
    finally:
        if server is not None:
            server.stop()
    return {
        "size": size,
        "params": n_params,
        "snapshot_bytes": snapshot_bytes,
        "stall": stall,
        "training": training,
        "other_cpu_cores": load.other_cores,
    }


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | blocking round s | async stall s (snapshot s) | async stall / blocking round "
        "| async latency s | trainer RSS extra blocking / async MB | snapshot MB | other load (cores) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r["stall"]
        if s is None:
            continue
        snap = f"{s['async_snapshot_s']:.3f}" if s["async_snapshot_s"] is not None else "-"
        latency = f"{s['async_latency_s']:.3f}" if s["async_latency_s"] is not None else "-"
        lines.append(
            f"| {r['size']} | {s['blocking_round_s']:.3f} | {s['async_stall_s']:.3f} ({snap}) "
            f"| **{s['ratio_async_stall_over_blocking_round']:.2f}** | {latency} "
            f"| {s['trainer_rss_extra_bytes']['blocking'] / MB:.0f} / {s['trainer_rss_extra_bytes']['async'] / MB:.0f} "
            f"| {r['snapshot_bytes'] / MB:.0f} | {r['other_cpu_cores']:.2f} |"
        )
    lines += [
        "",
        "| model | steps (batch x seq, optimizer) | step compute s, no sync | blocking round s (hook) "
        "| wall s: no sync / blocking / async | async / blocking | compute inflation under async |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t = r["training"]
        if t is None:
            continue
        m = t["modes"]
        lines.append(
            f"| {r['size']} | {t['steps']} ({t['batch']} x {t['seq']}, {t['optimizer']}) | {m['none']['compute_s_median']:.3f} "
            f"| {m['blocking']['hook_s_median']:.3f} "
            f"| {m['none']['wall_s']:.2f} / {m['blocking']['wall_s']:.2f} / {m['async']['wall_s']:.2f} "
            f"| **{t['ratio_async_over_blocking_wall']:.2f}** | {t['compute_inflation_async']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="llama-74M,llama-296M", help=f"comma-separated, from {SIZES}")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per mode and block")
    parser.add_argument("--blocks", type=int, default=2, help="blocks of each mode, alternating")
    parser.add_argument("--steps", type=int, default=12, help="training steps per mode")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--phases", default="stall,training", help="comma-separated: stall, training")
    parser.add_argument("--split-cores", action="store_true", help="trainer and server on separate halves of the CPUs")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound in seconds on startup and each call")
    parser.add_argument("--server", help="a running server to use (with --model-dir); its weights are overwritten")
    parser.add_argument("--model-dir", type=Path, help="the checkpoint --server serves")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"), help="--server's token")
    parser.add_argument("--out", type=Path, help="JSON output path")
    parser.add_argument("--md", type=Path, help="markdown output path")
    args = parser.parse_args()
    if args.server and not args.model_dir:
        parser.error("--server needs --model-dir")
    cpus = sorted(os.sched_getaffinity(0))
    args.server_cpus = None
    if args.split_cores:
        if len(cpus) < 2:
            parser.error("--split-cores needs 2 CPUs or more")
        trainer_cpus, args.server_cpus = set(cpus[: len(cpus) // 2]), set(cpus[len(cpus) // 2 :])
        os.sched_setaffinity(0, trainer_cpus)
    torch.set_num_threads(max(1, len(cpus) // 2))
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()] if not args.server else ["given"]
    with tempfile.TemporaryDirectory(prefix="wt-async-bench-") as tmp:
        results = [bench_size(size, args, Path(tmp)) for size in sizes]
    table = markdown(results)
    print(table)
    report = {
        "benchmark": "async_send",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        # The measurement's knobs, not where it wrote or which server it used.
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("api_key", "out", "md", "server", "model_dir", "server_cpus")},
        "cores": "split: trainer, server" if args.split_cores else "shared",
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(f"`send: async` against `send: blocking` into vLLM (fp32; {os.cpu_count()} CPUs). "
                           f"See `benchmarks/async_send.py`.\n\n{table}\n")  # fmt: skip
    wrong = [
        f"{r['size']}: {d:.1g}"
        for r in results
        for d in [
            *([r["stall"]["max_logprob_diff"]] if r["stall"] else []),
            *((m["max_logprob_diff"] for m in r["training"]["modes"].values()) if r["training"] else []),
        ]
        if d is not None and not d <= LOGPROB_TOLERANCE
    ]
    if wrong:
        print(f"the server's logprobs differ from the trainer's model by more than {LOGPROB_TOLERANCE:g}: {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
