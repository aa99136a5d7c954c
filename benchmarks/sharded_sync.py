"""One sync round per sharding scheme, 2 trainer ranks, side by side in one run.

Run from the repository root::

    python benchmarks/sharded_sync.py --params 100M --out benchmarks/results/sharded_sync.json

Smoke size (what CI runs, under a minute)::

    python benchmarks/sharded_sync.py --params 2M --cycles 1 --schemes fsdp1-orig,zero3,zero2 --wires bfloat16 --out /tmp/s.json

What it measures: a ``torch_dist`` round of the synthetic Llama
(``wt_callbacks.demos.synthetic_llama``) from 2 trainer ranks (spawned, gloo
default group, one torch thread each) into the reference receiver (a third
process), over the transport ``auto`` picks (the shm ring on one host), for
every scheme ``ModuleSource`` detects: FSDP1 (``FullyShardedDataParallel``
with ``device_id=cpu``, a unit per decoder layer and the root unit, both
``use_orig_params`` settings), FSDP2 (``fully_shard`` per decoder layer and at
the root, for reference), DeepSpeed ZeRO-3 and ZeRO-2 (``deepspeed.initialize``
with torch's AdamW, not stepped), each on an fp32 and a bf16 wire. Each
scheme holds its own model from its own seed, so a passing checksum proves
its round reached the receiver.

``--cycles`` cycles visit every (scheme, wire) in turn: ``trainer_init`` on
both ranks, one warm-up and one timed ``send_weights`` round, both ranks
starting each round together. Interleaving makes a change in load on a shared
machine hit all of them alike. Columns: the timed rounds' median seconds and
gather seconds (rank 0's ``engine.last_stats``), the sender's peak extra RSS
over the timed rounds (``wt_callbacks.demos.memory``; the ranks run with
``MALLOC_MMAP_THRESHOLD_`` fixed so freed memory leaves at once) against the
bound (the transport's buffers and the largest tensor in flight, plus what
the scheme gathers at once, twice: gloo copies a CPU all-gather's output), and
the checksum verdict after the last cycle: the receiver's ``GET
/weight_checksums`` against the trainer's full weights gathered independently
(``wt_callbacks.demos.full_weights``) and rounded through the wire dtype.

Output: JSON (``--out``) and a markdown table on stdout; exit status 1 if a
checksum differs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from wt_callbacks.demos.full_weights import full_checksums
from wt_callbacks.demos.memory import peak_extra_rss
from wt_callbacks.demos.multiprocess import free_port, leave_group_together
from wt_callbacks.demos.receiver_process import receiver_checksums
from wt_callbacks.demos.synthetic_llama import TRAINER_SEED, DecoderLayer, build_model, parse_size, shape_for
from wt_callbacks.transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
from wt_callbacks.transfer.backends.torch_dist import DEFAULT_PACKED_BUFFER_SIZE_BYTES
from wt_callbacks.transfer.backends.torch_dist.wire import DEFAULT_PACKED_NUM_BUFFERS

from harness import GB, MiB, checksum_exit_status, spawn_ranks, start_synthetic_receiver

REPO_ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
WORLD_SIZE = 2
SCHEMES = ("fsdp1", "fsdp1-orig", "fsdp2", "zero3", "zero2")
WIRES = ("float32", "bfloat16")
MALLOC_MMAP_THRESHOLD = "65536"


@dataclass(frozen=True)
class RankArgs:
    """What every spawned rank needs (picklable)."""

    params_text: str
    schemes: tuple[str, ...]
    wires: tuple[str, ...]
    cycles: int
    timeout_s: float
    pg_port: int
    receiver_url: str
    out_path: str


def wrap(scheme: str, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` sharded as ``scheme`` shards it, as the framework would hold it."""
    if scheme.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({DecoderLayer}),
            device_id=torch.device("cpu"),
            use_orig_params=scheme == "fsdp1-orig",
        )
    if scheme == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": int(scheme[-1])},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def gathered_at_once(scheme: str, module: torch.nn.Module, plain_bytes: dict[str, int], wire: torch.dtype | None) -> int:
    """Bytes the scheme gathers at once at most: an FSDP1 unit (wire dtype), a
    ZeRO-3 group (parameter dtype), an FSDP2 parameter (wire dtype)."""
    def on_wire(nbytes: int) -> int:
        return nbytes // 2 if wire == torch.bfloat16 else nbytes

    if scheme.startswith("fsdp1"):
        layer = sum(v for k, v in plain_bytes.items() if k.startswith("model.layers.0."))
        root = sum(v for k, v in plain_bytes.items() if not k.startswith("model.layers."))
        return on_wire(max(layer, root))
    if scheme == "fsdp2":
        return on_wire(max(plain_bytes.values()))
    if scheme == "zero3":
        from wt_callbacks.transfer.sources.zero3 import Zero3Groups

        groups = Zero3Groups(module)
        sizes = {m.name: m.nbytes for m in groups.parameters()}
        return max(sum(sizes[n] for n in g) for g in groups.groups(list(sizes)))
    return 0


def visit(module: torch.nn.Module, wire: str, rank: int, args: RankArgs) -> dict[str, Any]:
    """``trainer_init``, a warm-up round, then a timed round; this rank's stats."""
    client = HTTPVLLMWeightSyncClient(args.receiver_url, timeout=args.timeout_s)  # only rank 0 calls it
    config = {"timeout_s": args.timeout_s, **({"dtype": wire} if wire != "float32" else {})}
    engine = WeightTransferTrainerFactory.trainer_init(
        "torch_dist", config, {"master_address": LOOPBACK, "master_port": 0, "rank": rank},
        client=client, source=ModuleSource(module),
    )  # fmt: skip
    try:
        dist.barrier()
        engine.send_weights("warm-up")
        dist.barrier()
        with peak_extra_rss() as rss:
            engine.send_weights("timed")
        stats = engine.last_stats
        return {"seconds": stats.seconds, "gather_seconds": stats.gather_seconds, "bytes": stats.bytes,
                "rss_extra": rss.extra, "transport": engine.group.transport if engine.group else None}  # fmt: skip
    finally:
        engine.shutdown()
        client.close()


def rank_main(rank: int, args: RankArgs) -> None:
    """One trainer rank: ``args.cycles`` cycles over every (scheme, wire); rank 0 writes the rows."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{LOOPBACK}:{args.pg_port}", rank=rank, world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )  # fmt: skip
    try:
        if any(s.startswith("zero") for s in args.schemes):
            from wt_callbacks.demos.deepspeed_cpu import skip_shm_comm_op

            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
            skip_shm_comm_op()
        shape = shape_for(parse_size(args.params_text))
        plain = build_model(shape, TRAINER_SEED)
        plain_bytes = {n: p.numel() * p.element_size() for n, p in plain.named_parameters()}
        del plain
        modules = {s: wrap(s, build_model(shape, TRAINER_SEED + 1 + i)) for i, s in enumerate(args.schemes)}
        visits = [(s, w) for s in args.schemes for w in args.wires]
        stats: dict[tuple[str, str], list[dict[str, Any]]] = {v: [] for v in visits}
        verdicts: dict[tuple[str, str], dict[str, Any]] = {}
        for cycle in range(args.cycles):
            for scheme, wire in visits:
                stats[(scheme, wire)].append(visit(modules[scheme], wire, rank, args))
                if cycle == args.cycles - 1:
                    via = getattr(torch, wire) if wire != "float32" else None
                    expected = full_checksums(modules[scheme], via_dtype=via)  # a collective
                    if rank == 0:
                        got = receiver_checksums(args.receiver_url, args.timeout_s)
                        bad = sorted(n for n in set(expected) | set(got) if got.get(n) != expected.get(n))
                        verdicts[(scheme, wire)] = {"passed": not bad, "first_mismatched": bad[:5]}
        largest = max(plain_bytes.values())
        rows = []
        for scheme, wire in visits:
            wire_dtype = getattr(torch, wire)
            on_wire = largest // 2 if wire_dtype == torch.bfloat16 else largest
            gathered = gathered_at_once(scheme, modules[scheme], plain_bytes, wire_dtype)
            bound = DEFAULT_PACKED_NUM_BUFFERS * DEFAULT_PACKED_BUFFER_SIZE_BYTES + on_wire + 2 * gathered
            timed = stats[(scheme, wire)]
            rows.append({
                "scheme": scheme, "wire": wire, "source_scheme": ModuleSource(modules[scheme]).scheme,
                "transport": timed[-1]["transport"], "rounds": timed,
                "median_s": statistics.median(r["seconds"] for r in timed),
                "median_gather_s": statistics.median(r["gather_seconds"] for r in timed),
                "bytes": timed[-1]["bytes"], "rss_extra_max": max(r["rss_extra"] for r in timed),
                "gathered_at_once": gathered, "bound": bound, "model_bytes": sum(plain_bytes.values()),
                "checksum": verdicts.get((scheme, wire)),
            })  # fmt: skip
        per_rank: list[Any] = [None] * WORLD_SIZE
        dist.all_gather_object(per_rank, [max(r["rss_extra"] for r in stats[v]) for v in visits])
        if rank == 0:
            for row, rank1 in zip(rows, per_rank[1]):
                row["rank1_rss_extra_max"] = rank1
            Path(args.out_path).write_text(json.dumps(rows))
    finally:
        leave_group_together()


def markdown_table(result: dict[str, Any]) -> str:
    m = result["model"]
    lines = [
        f"{WORLD_SIZE} trainer ranks (gloo), synthetic Llama fp32 {m['params'] / 1e6:.1f}M params (hidden "
        f"{m['hidden']}, {m['layers']} layers, vocab {m['vocab']}); {result['cycles']} timed round(s) per row, "
        f"interleaved; load average {result['machine']['loadavg_before'][0]:.2f} before, "
        f"{result['machine']['loadavg_after'][0]:.2f} after.",
        "",
        "| scheme | wire | transport | median s | wire GB/s | median gather s | sender peak extra RSS MiB "
        "| bound MiB | rank 1 MiB | full model MiB (fp32) | checksum |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['scheme']} | {r['wire']} | {r['transport']} | {r['median_s']:.3f} | "
            f"{r['bytes'] / r['median_s'] / GB:.2f} | {r['median_gather_s']:.3f} | {r['rss_extra_max'] / MiB:.0f} | "
            f"{r['bound'] / MiB:.0f} | {r['rank1_rss_extra_max'] / MiB:.0f} | {r['model_bytes'] / MiB:.0f} | "
            f"{'pass' if r['checksum']['passed'] else 'FAIL'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="100M", help="target parameter count (default 100M)")
    parser.add_argument("--wires", default=",".join(WIRES), help=f"comma-separated subset of {WIRES}")
    parser.add_argument("--cycles", type=int, default=3, help="timed rounds per (scheme, wire) (default 3)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated subset of {SCHEMES}")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/sharded_sync.json")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound in seconds on every wait")
    args = parser.parse_args(argv)
    schemes = tuple(args.schemes.split(","))
    wires = tuple(args.wires.split(","))
    if args.cycles < 1 or not set(schemes) <= set(SCHEMES) or not set(wires) <= set(WIRES):
        parser.error(f"--cycles must be >= 1, --schemes a subset of {SCHEMES} and --wires of {WIRES}")

    shape = shape_for(parse_size(args.params))
    loadavg_before = os.getloadavg()
    # The ranks inherit it at exec: glibc reads it once, at start-up.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MALLOC_MMAP_THRESHOLD
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wt-sharded-") as tmp:
        with start_synthetic_receiver(args.params, torch_threads=1, timeout_s=args.timeout) as receiver:
            rank_args = RankArgs(args.params, schemes, wires, args.cycles, args.timeout, free_port(), receiver.url,
                                 str(Path(tmp) / "rows.json"))  # fmt: skip
            budget_s = args.timeout * (len(schemes) * len(wires) * (3 * args.cycles + 1) + 2)
            try:
                spawn_ranks(rank_main, (rank_args,), WORLD_SIZE, budget_s)
            except BaseException:
                print(f"receiver log:\n{receiver.log[-3000:]}", file=sys.stderr)
                raise
        rows = json.loads(Path(rank_args.out_path).read_text())
    result = {
        "machine": {
            "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "loadavg_before": loadavg_before, "loadavg_after": os.getloadavg(),
        },
        "model": {"params": shape.num_params, **vars(shape)},
        "world_size": WORLD_SIZE, "cycles": args.cycles, "malloc_mmap_threshold": MALLOC_MMAP_THRESHOLD,
        "rows": rows,
    }  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown_table(result))
    print(f"\nwrote {args.out}")
    failed = [f"{r['scheme']} {r['wire']}" for r in rows if not r["checksum"]["passed"]]
    return checksum_exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
