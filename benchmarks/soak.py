"""Many rounds into one server: do file descriptors, threads, ring files or memory grow?

Run from the repository root with the project venv::

    python benchmarks/soak.py --target receiver --rounds 2000 --out benchmarks/results/soak_receiver.json
    WT_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/soak.py --target vllm --rounds 300 \\
        --out benchmarks/results/soak_vllm.json

The model is the toy task's 2-layer Llama (fp32), served by the reference
receiver (``--model DIR``) or by vLLM with our plugin. A ``WeightSync`` (the
driver the callbacks use: pause ``keep``, start, update, finish, resume)
pushes ``--rounds`` rounds, the weights changed before each. At each of
``--at`` rounds (and after round 1) it records, for this trainer process and
for the server's processes: open file descriptors, threads, resident memory;
and the project's ring files in ``/dev/shm``. After the last round the
server's weights are checked (receiver: checksums; vLLM: greedy logprobs).
Output: the series as a table on stdout and JSON (``--out``). Exit status 1
when a round failed or the last round's weights are not the trainer's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from wt_callbacks.checksums import module_checksums
from wt_callbacks.config import SyncConfig
from wt_callbacks.demos import toy_task
from wt_callbacks.demos.receiver_process import start_receiver
from wt_callbacks.demos.vllm_server import find_vllm_python, max_logprob_diff, start_vllm_server
from wt_callbacks.sync import WeightSync

from harness import CpuLoadMeter, ProcessStats, ring_file_count, server_pids

LOGPROB_TOLERANCE = 1e-3
PROMPTS = [[1, 5, 9, 13, 2], [1, 7, 7, 3]]


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=generator) * 1e-3)


class Server:
    """The receiver or a vLLM server on the toy model: its URL, its processes, a final check."""

    def __init__(self, target: str, model_dir: Path, workdir: Path, timeout_s: float) -> None:
        self.target = target
        if target == "receiver":
            self._receiver = start_receiver("", extra_args=("--model", str(model_dir)), timeout_s=timeout_s)
            self.url = self._receiver.url
        else:
            python, reason = find_vllm_python()
            if python is None:
                print(f"--target vllm: {reason}", file=sys.stderr)
                sys.exit(2)
            self._vllm = start_vllm_server(python, model_dir, workdir / "vllm.log", timeout_s=timeout_s)
            self.url = self._vllm.url

    def pids(self) -> list[int]:
        return [self._receiver.proc.pid] if self.target == "receiver" else server_pids(self._vllm)

    def holds(self, model: torch.nn.Module) -> tuple[bool, str]:
        if self.target == "receiver":
            equal = self._receiver.checksums() == module_checksums(model)
            return equal, "checksums equal" if equal else "checksums differ"
        diff = max_logprob_diff(self._vllm, model, PROMPTS)
        return diff <= LOGPROB_TOLERANCE, f"max logprob diff {diff:.2e}"

    def stop(self) -> None:
        (self._receiver if self.target == "receiver" else self._vllm).stop()


def sample(round_: int, server: Server, round_seconds: list[float]) -> dict[str, Any]:
    recent = sorted(round_seconds[-50:])
    return {
        "round": round_,
        "trainer": ProcessStats.of([os.getpid()]).row(),
        "server": ProcessStats.of(server.pids()).row(),
        "ring_files": ring_file_count(),
        "median_round_s": recent[len(recent) // 2] if recent else None,
    }


def print_series(series: list[dict[str, Any]]) -> None:
    print(f"{'round':>6} | {'trainer fds':>11} {'threads':>7} {'RSS MiB':>8} | {'server fds':>10} {'threads':>7} "
          f"{'RSS MiB':>8} | {'ring files':>10} | {'round s':>8}")  # fmt: skip
    for row in series:
        t, s = row["trainer"], row["server"]
        print(f"{row['round']:>6} | {t['fds']:>11} {t['threads']:>7} {t['rss_mib']:>8} | {s['fds']:>10} "
              f"{s['threads']:>7} {s['rss_mib']:>8} | {row['ring_files']:>10} | {row['median_round_s'] or 0:>8.4f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("receiver", "vllm"), default="receiver")
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--at", default="10,100,1000,2000", help="rounds after which to sample (comma-separated)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    at = {1, args.rounds} | {int(r) for r in args.at.split(",") if int(r) <= args.rounds}
    torch.set_num_threads(1)
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="wt-soak-") as tmp:
        workdir = Path(tmp)
        model_dir = toy_task.save_pretrained(workdir / "model")
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        server = Server(args.target, model_dir, workdir, args.timeout_s)
        ws = WeightSync(SyncConfig(servers=[server.url], timeout_s=args.timeout_s, pause="keep", on_error="warn"))
        series: list[dict[str, Any]] = []
        round_seconds: list[float] = []
        failed = 0
        try:
            ws.setup(model)
            with CpuLoadMeter(*server.pids()) as load:
                for r in range(1, args.rounds + 1):
                    perturb(model, r)
                    start = time.perf_counter()
                    failed += ws.sync(r) is None
                    round_seconds.append(time.perf_counter() - start)
                    if r in at:
                        series.append(sample(r, server, round_seconds))
            held, check = server.holds(model)
        finally:
            ws.close()
            server.stop()
    print(f"{args.target}: {args.rounds} rounds of the toy model ({sum(p.numel() for p in model.parameters())} "
          f"parameters), {failed} failed; last round: {check}; other processes used {load.other_cores:.2f} cores")  # fmt: skip
    print_series(series)
    result = {
        "target": args.target, "rounds": args.rounds, "failed_rounds": failed, "final_check": check,
        "other_cores": load.other_cores, "machine": platform.platform(), "series": series,
    }  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    sys.exit(0 if held and not failed else 1)


if __name__ == "__main__":
    main()
