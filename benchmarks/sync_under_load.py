"""Completions while weights sync every few seconds: generation downtime per sync and request
latency, ``commit: inline``, ``staged`` and ``prepared``, side by side in one run.

Run from the repository root with the project venv::

    WT_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/sync_under_load.py --target vllm --size llama-74M \\
        --clients 8 --seconds 120 --sync-every 3 --out benchmarks/results/sync_under_load.json

The model is ``--size`` (the toy task's 2-layer Llama, or a Llama of
``vllm_push_vs_reload.py``, fp32), served by vLLM with our plugin or by the
reference receiver (``--target receiver``). ``--clients`` threads each send
greedy completions back to back (``--max-tokens`` tokens of a fixed prompt,
token ids in and out; from vLLM streamed, one event per token, with the time
each token arrived). Meanwhile a ``WeightSync`` with ``pause: keep`` pushes
changed weights every ``--sync-every`` seconds, with ``commit: inline`` (the
server pauses before the first byte), ``commit: staged`` (it receives while
it generates and pauses for the commit alone) and ``commit: prepared`` (it also
processes the round before the pause) in alternating blocks
(``--blocks`` of each, ``--seconds`` in all), each block its own ``WeightSync``.
A mode written ``prepared@10`` (or ``staged@10``) asks the server to stage its
rounds at that niceness (``staging_nice``), as ``send: async`` does by default.

Per commit mode:

* **downtime per sync** (streamed only): the longest interval overlapping a
  round (the trainer's call, start to end) in which no stream received a
  token, minus the median gap between two tokens of one stream away from
  rounds: what a sync adds to the wait for the next token. The ratios
  staged / inline and prepared / inline compare the medians over the rounds.
* **latency**: requests that *straddled* a sync (their lifetime overlapped a
  round) and those *clear* of syncs: count, failed, p50 and p99; the ratio
  p99 straddled / p99 clear.
* the rounds' seconds and the servers' paused seconds (``/pause`` to the
  ``/resume`` answer) as the trainer measured them.
* the server's resident memory (all its processes) before the first round
  and its peak after each round: its growth against the model's fp32 bytes.

``--server URL --model-dir DIR`` uses a server that is already up (serving
``DIR``; its weights are overwritten). Exit status 1 when any request or
round failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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
from wt_callbacks.demos.receiver_process import start_receiver
from wt_callbacks.demos.vllm_server import find_vllm_python, start_vllm_server
from wt_callbacks.sync import WeightSync
from wt_callbacks.transfer.validation import check_niceness
from wt_callbacks.verify import served_model_name

from harness import CpuLoadMeter, ProcessStats, server_pids
from vllm_push_vs_reload import SIZES, build_model_dir

PROMPT = [1, 5, 9, 13, 2, 7, 7, 3]
COMMITS = ("inline", "staged", "prepared")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def client_loop(
    url: str, model_name: str | None, headers: dict[str, str], max_tokens: int, stream: bool,
    stop: threading.Event, out: list[dict[str, Any]],
) -> None:  # fmt: skip
    """Back-to-back completions until ``stop``; one record per request (with
    its tokens' arrival times when streamed)."""
    session = requests.Session()
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, "stream": stream, **({"model": model_name} if model_name else {})}  # fmt: skip
    while not stop.is_set():
        start = time.monotonic()
        tokens: list[float] = []
        try:
            answer = session.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120, stream=stream)
            error = None if answer.status_code == 200 else f"HTTP {answer.status_code}: {answer.text[:200]}"
            if stream and error is None:
                for line in answer.iter_lines():
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        tokens.append(time.monotonic())
        except requests.RequestException as e:
            error = f"{type(e).__name__}: {e}"
        out.append({"start": start, "end": time.monotonic(), "error": error, "tokens": tokens})


def latency(records: list[dict[str, Any]], rounds: list[tuple[float, float]]) -> dict[str, dict[str, Any]]:
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


def downtimes(records: list[dict[str, Any]], rounds: list[tuple[float, float]]) -> list[float] | None:
    """Per round: the longest token-free interval overlapping it, minus the
    median inter-token gap of a stream away from rounds (``None`` unstreamed)."""
    arrivals = sorted(t for r in records for t in r["tokens"])
    if not arrivals:
        return None
    near = [(s - 1.0, e + 1.0) for s, e in rounds]
    gaps = [
        b - a
        for r in records
        for a, b in zip(r["tokens"], r["tokens"][1:])
        if not any(a < e and b > s for s, e in near)
    ]
    typical = statistics.median(gaps) if gaps else 0.0
    out = []
    for start, end in rounds:
        longest = max((b - a for a, b in zip(arrivals, arrivals[1:]) if a < end and b > start), default=end - start)
        out.append(max(longest - typical, 0.0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("receiver", "vllm"), default="vllm")
    parser.add_argument("--size", default="toy", help=f"one of {SIZES}")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0, help="in all, over every block of both modes")
    parser.add_argument("--sync-every", type=float, default=3.0)
    parser.add_argument("--blocks", type=int, default=2, help="blocks of each commit mode, alternating")
    parser.add_argument(
        "--commits", default=",".join(COMMITS), help=f"comma-separated, from {COMMITS}, each optionally @niceness"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--server", help="a running vLLM server to use (with --model-dir); its weights are overwritten")
    parser.add_argument("--model-dir", type=Path, help="the checkpoint --server serves")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"), help="--server's token")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.server and not args.model_dir:
        parser.error("--server needs --model-dir")
    commits = [c.strip() for c in args.commits.split(",") if c.strip()]
    try:
        keys = {c: mode_keys(c) for c in commits}
    except ValueError as e:
        parser.error(f"--commits: {e}")
    torch.set_num_threads(1)
    from transformers import LlamaForCausalLM

    stream = args.target == "vllm"
    with tempfile.TemporaryDirectory(prefix="wt-load-") as tmp:
        server: Any = None
        if args.server:
            url, model_dir, pids = args.server.rstrip("/"), args.model_dir, []
        else:
            model_dir = build_model_dir(args.size, Path(tmp) / "model")
            if args.target == "receiver":
                server = start_receiver("", extra_args=("--model", str(model_dir)), timeout_s=args.timeout_s)
                pids = [server.proc.pid]
            else:
                python, reason = find_vllm_python()
                if python is None:
                    print(f"--target vllm: {reason}", file=sys.stderr)
                    sys.exit(2)
                server = start_vllm_server(python, model_dir, Path(tmp) / "vllm.log", timeout_s=args.timeout_s)
                pids = server_pids(server)
            url = server.url
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model_bytes = sum(p.numel() * 4 for p in model.parameters())
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        base = SyncConfig(servers=[url], api_key=args.api_key, timeout_s=args.timeout_s, pause="keep", on_error="warn")
        rounds: dict[str, list[tuple[float, float]]] = {c: [] for c in commits}
        paused_s: dict[str, list[float]] = {c: [] for c in commits}
        windows: dict[str, list[tuple[float, float]]] = {c: [] for c in commits}
        failed_rounds = 0
        rss_peak = rss_before = 0
        stop = threading.Event()
        per_client: list[list[dict[str, Any]]] = [[] for _ in range(args.clients)]
        step = 0
        try:
            name = served_model_name(url, timeout_s=30, api_key=args.api_key)
            threads = [
                threading.Thread(
                    target=client_loop, args=(url, name, headers, args.max_tokens, stream, stop, out), daemon=True
                )
                for out in per_client
            ]
            block_s = args.seconds / max(1, args.blocks * len(commits))
            with CpuLoadMeter(*pids) as load:
                for t in threads:
                    t.start()
                for block in range(args.blocks):
                    for commit in commits:
                        ws = WeightSync(dataclasses.replace(base, **keys[commit]))
                        ws.setup(model)
                        if not rss_before:
                            rss_before = ProcessStats.of(pids).rss_bytes
                        assert ws.sync(step) is not None, "the block's first round failed"
                        opened = time.monotonic()
                        deadline = opened + block_s
                        while time.monotonic() < deadline:
                            time.sleep(min(args.sync_every, max(deadline - time.monotonic(), 0)))
                            step += 1
                            with torch.no_grad():
                                for p in model.parameters():
                                    p.mul_(1.0001)
                            start = time.monotonic()
                            result = ws.sync(step)
                            rounds[commit].append((start, time.monotonic()))
                            failed_rounds += result is None
                            if result is not None:
                                paused_s[commit].append(result.generation_paused_seconds)
                            rss_peak = max(rss_peak, ProcessStats.of(pids).rss_bytes)
                        ws.close()
                        windows[commit].append((opened, time.monotonic()))
                        print(f"block {block} {commit}: {len(rounds[commit])} rounds so far", flush=True)
                stop.set()
                for t in threads:
                    t.join(timeout=150)
        finally:
            stop.set()
            if server is not None:
                server.stop()
    records = [r for out in per_client for r in out]
    modes = {}
    for commit in commits:
        mine = [r for r in records if any(s <= r["start"] and r["end"] <= e for s, e in windows[commit])]
        summary = latency(mine, rounds[commit])
        down = downtimes(mine, rounds[commit])
        straddled, clear = summary["straddled a sync"]["p99_s"], summary["clear of syncs"]["p99_s"]
        modes[commit] = {
            "rounds": len(rounds[commit]),
            "round_s_median": statistics.median(e - s for s, e in rounds[commit]) if rounds[commit] else None,
            "generation_paused_s_median": statistics.median(paused_s[commit]) if paused_s[commit] else None,
            "downtime_s": down,
            "downtime_s_median": statistics.median(down) if down else None,
            "requests": summary,
            "ratio_p99_straddled_over_clear": straddled / clear if straddled and clear else None,
        }
    result = {
        "target": args.target, "size": args.size if not args.server else "given", "clients": args.clients,
        "seconds": args.seconds, "sync_every_s": args.sync_every, "blocks": args.blocks, "streamed": stream,
        "failed_rounds": failed_rounds, "modes": modes, "model_bytes": model_bytes,
        "server_rss_before_bytes": rss_before, "server_rss_peak_bytes": rss_peak,
        "server_rss_growth_over_model_bytes": (rss_peak - rss_before) / model_bytes if pids else None,
        "other_cores": load.other_cores, "machine": platform.platform(),
    }  # fmt: skip
    for commit in [c for c in commits if c != "inline"]:
        if "inline" in modes and modes["inline"]["downtime_s_median"] and modes[commit]["downtime_s_median"]:
            result[f"ratio_downtime_{commit}_over_inline"] = modes[commit]["downtime_s_median"] / modes["inline"]["downtime_s_median"]
    print(f"{args.target} {result['size']}: {args.clients} clients, {args.seconds:g} s, a sync every {args.sync_every:g} s "
          f"({failed_rounds} rounds failed); other processes used {load.other_cores:.2f} cores")  # fmt: skip
    print(f"{'commit':<11} {'rounds':>6} {'round s':>8} {'paused s':>8} {'downtime s':>10} "
          f"{'requests':<18} {'count':>6} {'failed':>6} {'p50 s':>7} {'p99 s':>7}")  # fmt: skip
    for commit, m in modes.items():
        for i, (cls, s) in enumerate(m["requests"].items()):
            head = (
                f"{commit:<11} {m['rounds']:>6} {_f(m['round_s_median'], 8)} {_f(m['generation_paused_s_median'], 8)} "
                f"{_f(m['downtime_s_median'], 10)}"
                if i == 0 else " " * 47
            )  # fmt: skip
            print(f"{head} {cls:<18} {s['requests']:>6} {s['failed']:>6} {_f(s['p50_s'], 7)} {_f(s['p99_s'], 7)}")
            for error in s["errors"]:
                print(f"  {error}")
        print(f"{'':<11} p99 straddled / clear: {_f(m['ratio_p99_straddled_over_clear'], 5, 2)}")
    for commit in commits:
        if f"ratio_downtime_{commit}_over_inline" in result:
            print(f"downtime per sync, {commit} / inline: {result[f'ratio_downtime_{commit}_over_inline']:.2f}")
    if result["server_rss_growth_over_model_bytes"] is not None:
        print(f"server RSS growth: {(rss_peak - rss_before) / 1e6:.0f} MB = "
              f"{result['server_rss_growth_over_model_bytes']:.2f} x the model's {model_bytes / 1e6:.0f} MB")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    failed = failed_rounds + sum(s["failed"] for m in modes.values() for s in m["requests"].values())
    sys.exit(1 if failed else 0)


def mode_keys(mode: str) -> dict[str, Any]:
    """``prepared@10`` -> the ``SyncConfig`` keys ``commit: prepared, staging_nice: 10``."""
    commit, _, nice = mode.partition("@")
    if commit not in COMMITS or (nice and (commit == "inline" or not nice.isdigit())):
        raise ValueError(f"{mode!r} is not one of {COMMITS}, or staged/prepared@niceness")
    if nice:
        check_niceness(f"{mode!r}: staging_nice", int(nice))
    return {"commit": commit, "staging_nice": int(nice) if nice else None}


def _f(value: float | None, width: int, digits: int = 3) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


if __name__ == "__main__":
    main()
