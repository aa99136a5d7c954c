"""Completions while weights sync every few seconds: failed requests, and the
latency of requests that straddled a sync next to those that did not.

Run from the repository root with the project venv::

    WT_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/sync_under_load.py --target vllm \\
        --clients 8 --seconds 60 --sync-every 3 --out benchmarks/results/sync_under_load.json

The model is the toy task's 2-layer Llama (fp32), served by vLLM with our
plugin or by the reference receiver (``--target receiver``). ``--clients``
threads each send greedy completions back to back (``--max-tokens`` tokens
of a fixed prompt, token ids in and out); meanwhile a ``WeightSync`` with
``pause: keep`` pushes changed weights every ``--sync-every`` seconds. A
request *straddled* a sync when its lifetime overlapped a round (from the
pause to the resume); every other request is *clear*. Reported per class:
count, failed, p50 and p99 latency; and the rounds' seconds. Exit status 1
when any request or round failed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests
import torch

from wt_callbacks.config import SyncConfig
from wt_callbacks.demos import toy_task
from wt_callbacks.demos.receiver_process import start_receiver
from wt_callbacks.demos.vllm_server import find_vllm_python, start_vllm_server
from wt_callbacks.sync import WeightSync
from wt_callbacks.verify import served_model_name

from harness import CpuLoadMeter, server_pids

PROMPT = [1, 5, 9, 13, 2, 7, 7, 3]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def client_loop(url: str, model_name: str | None, max_tokens: int, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    """Back-to-back completions until ``stop``; one record per request."""
    session = requests.Session()
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, **({"model": model_name} if model_name else {})}  # fmt: skip
    while not stop.is_set():
        start = time.monotonic()
        try:
            answer = session.post(f"{url}/v1/completions", json=body, timeout=120)
            error = None if answer.status_code == 200 else f"HTTP {answer.status_code}: {answer.text[:200]}"
        except requests.RequestException as e:
            error = f"{type(e).__name__}: {e}"
        out.append({"start": start, "end": time.monotonic(), "error": error})


def classify(records: list[dict[str, Any]], rounds: list[tuple[float, float]]) -> dict[str, dict[str, Any]]:
    def straddles(r: dict[str, Any]) -> bool:
        return any(r["start"] < end and r["end"] > start for start, end in rounds)

    classes: dict[str, list[dict[str, Any]]] = {"straddled a sync": [], "clear of syncs": []}
    for r in records:
        classes["straddled a sync" if straddles(r) else "clear of syncs"].append(r)
    summary = {}
    for name, group in classes.items():
        ok = [r["end"] - r["start"] for r in group if r["error"] is None]
        summary[name] = {
            "requests": len(group),
            "failed": sum(r["error"] is not None for r in group),
            "p50_s": percentile(ok, 0.5),
            "p99_s": percentile(ok, 0.99),
            "errors": sorted({r["error"] for r in group if r["error"]})[:5],
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("receiver", "vllm"), default="vllm")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--sync-every", type=float, default=3.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="wt-load-") as tmp:
        model_dir = toy_task.save_pretrained(Path(tmp) / "model")
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        if args.target == "receiver":
            server: Any = start_receiver("", extra_args=("--model", str(model_dir)), timeout_s=args.timeout_s)
            pids = [server.proc.pid]
        else:
            python, reason = find_vllm_python()
            if python is None:
                print(f"--target vllm: {reason}", file=sys.stderr)
                sys.exit(2)
            server = start_vllm_server(python, model_dir, Path(tmp) / "vllm.log", timeout_s=args.timeout_s)
            pids = server_pids(server)
        ws = WeightSync(SyncConfig(servers=[server.url], timeout_s=args.timeout_s, pause="keep", on_error="warn"))
        records: list[dict[str, Any]] = []
        rounds: list[tuple[float, float]] = []
        failed_rounds = 0
        stop = threading.Event()
        try:
            ws.setup(model)
            assert ws.sync(0) is not None, "the first round failed"
            name = served_model_name(server.url, timeout_s=30)
            per_client: list[list[dict[str, Any]]] = [[] for _ in range(args.clients)]
            threads = [
                threading.Thread(target=client_loop, args=(server.url, name, args.max_tokens, stop, out), daemon=True)
                for out in per_client
            ]
            with CpuLoadMeter(*pids) as load:
                for t in threads:
                    t.start()
                deadline = time.monotonic() + args.seconds
                step = 0
                while time.monotonic() < deadline:
                    time.sleep(min(args.sync_every, max(deadline - time.monotonic(), 0)))
                    step += 1
                    with torch.no_grad():
                        for p in model.parameters():
                            p.mul_(1.0001)
                    start = time.monotonic()
                    failed_rounds += ws.sync(step) is None
                    rounds.append((start, time.monotonic()))
                stop.set()
                for t in threads:
                    t.join(timeout=150)
            records = [r for out in per_client for r in out]
        finally:
            stop.set()
            ws.close()
            server.stop()
    summary = classify(records, rounds)
    round_s = [end - start for start, end in rounds]
    print(f"{args.target}: {args.clients} clients x {args.seconds:g} s, a sync every {args.sync_every:g} s "
          f"({len(rounds)} rounds, {failed_rounds} failed, median {statistics.median(round_s):.3f} s); "
          f"other processes used {load.other_cores:.2f} cores")  # fmt: skip
    print(f"{'requests':<18} {'count':>6} {'failed':>6} {'p50 s':>8} {'p99 s':>8}")
    for cls, s in summary.items():
        p50 = f"{s['p50_s']:.3f}" if s["p50_s"] is not None else "-"
        p99 = f"{s['p99_s']:.3f}" if s["p99_s"] is not None else "-"
        print(f"{cls:<18} {s['requests']:>6} {s['failed']:>6} {p50:>8} {p99:>8}")
        for error in s["errors"]:
            print(f"  {error}")
    result = {
        "target": args.target, "clients": args.clients, "seconds": args.seconds, "sync_every_s": args.sync_every,
        "rounds": len(rounds), "failed_rounds": failed_rounds, "round_s": round_s, "requests": summary,
        "other_cores": load.other_cores, "machine": platform.platform(),
    }  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    failed = failed_rounds + sum(s["failed"] for s in summary.values())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
