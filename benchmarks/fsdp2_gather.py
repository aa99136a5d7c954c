"""FSDP2 with 2 trainer ranks: the gather, per parameter vs bucketed, against the raw all-gather.

Run from the repository root::

    python benchmarks/fsdp2_gather.py --params 100M --out benchmarks/results/fsdp2_gather.json

Smoke size (well under a minute)::

    python benchmarks/fsdp2_gather.py --params 2M --rounds 1 --out /tmp/fsdp2-smoke.json

What it measures: one ``torch_dist`` sync round of an FSDP2-sharded model
from 2 trainer ranks (spawned processes, gloo default group, ``fully_shard``
on every decoder layer and on the root, one torch thread each) into the
reference receiver (a third process), over 127.0.0.1. Rank 1 only joins the
all-gathers; rank 0 also packs and sends. Sources, in one run:

* ``bucketed``: ``ModuleSource``, the library's way: the local shards of a
  bucket of parameters are cast (bf16 wire) and packed into one buffer and
  gathered by one ``all_gather_into_tensor`` (``FSDP2Shards``).
* ``bucketed, rank 1 builds tensors``: the baseline
  ``NonSendersBuildTensorsSource``: the same, but rank 1 builds every full
  tensor and drops it (before ``WeightSource.gather_only``, a rank that
  does not send iterated the sender's pass).
* ``per-parameter``: the baseline ``PerParameterGatherSource``: each local
  shard cast, then ``DTensor.full_tensor()`` (what ``ModuleSource`` did
  before).
* ``bf16 gather-then-cast``: the baseline ``GatherThenCastSource``: the fp32
  shard is gathered with ``full_tensor()``, then the full tensor is cast.

each on an fp32 and (but gather-then-cast) a bf16 wire, and the ceiling:

* ``raw all-gather``: ``all_gather_into_tensor`` of the same shards
  (padded to equal size, as any all-gather needs), already packed, into
  preallocated outputs, in buckets of the same size and, separately, one
  call per tensor; in the wire dtype. Nothing but the collectives is timed.

Each source has its own seeded, sharded model (a seed each, so a passing
checksum proves that source's weights travelled). ``--rounds`` cycles each
visit every source in turn: ``trainer_init`` on both ranks, one warm-up and
one timed ``send_weights`` round, both ranks starting each round together
(rank 0 decides), then one timed pass over the source alone (rank 0
iterates it, rank 1 joins its gathers as in a round, nothing is sent: the
gather phase by itself); each cycle ends
with the raw all-gathers. Interleaving makes a change in load on a shared
machine hit all of them alike. After the last cycle's round of a source,
its checksums are checked. Columns: median/min round seconds and median
gather seconds (``engine.last_stats`` on rank 0; gather = time spent
producing tensors: casts, packs and all-gathers), the median gather-only
pass, bytes on the wire and all-gathered bytes per round, rank 1's median
round, the CPU cores used by processes other than the two ranks, the
receiver and this one (``CpuLoadMeter``), and the checksum verdict: the
receiver's ``GET /weight_checksums`` against ``module_checksums`` of the
gathered model rounded through the wire dtype. The ratios: each source's
gather throughput (round and gather-only pass) against the raw bucketed
all-gather's in the same dtype, bucketed over per-parameter, and
gather-then-cast over cast-before-gather.

Output: JSON (``--out``) and a markdown table on stdout; exit status 1 if a
checksum differs. The model is ``wt_callbacks.demos.synthetic_llama``'s, as in
``benchmarks/transfer_throughput.py``.
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
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wt_callbacks.checksums import module_checksums
from wt_callbacks.demos.multiprocess import free_port, leave_group_together
from wt_callbacks.demos.receiver_process import receiver_checksums
from wt_callbacks.demos.synthetic_llama import (
    TRAINER_SEED,
    ModelShape,
    SyntheticLlama,
    build_model,
    parse_size,
    shape_for,
)
from wt_callbacks.transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightSource,
    WeightTransferTrainerFactory,
    materialize_full_tensor,
)
from wt_callbacks.transfer.backends.torch_dist import DEFAULT_PACKED_BUFFER_SIZE_BYTES
from wt_callbacks.transfer.sources.fsdp2 import DEFAULT_GATHER_BUCKET_BYTES

from harness import GB, CpuLoadMeter, checksum_exit_status, start_synthetic_receiver

REPO_ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
WORLD_SIZE = 2


class PerParameterGatherSource(ModuleSource):
    """Baseline: cast each local shard, then ``DTensor.full_tensor()`` per parameter
    (``ModuleSource`` before the bucketed gather).

    The engine calls ``with_wire_dtype(config.wire_dtype)``; the inherited
    ``ModuleSource.with_wire_dtype`` returns this object (same dtype) or a
    ``copy.copy`` of it, so the baseline keeps this ``__iter__``. ``visit``
    checks that the engine's source is still of this type.
    """

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.module.named_parameters():
            tensor = param.detach()
            wire = self._wire(param.dtype)
            yield name, materialize_full_tensor(tensor if tensor.dtype == wire else tensor.to(wire))


class GatherThenCastSource(ModuleSource):
    """Baseline: all-gather each parameter in its own dtype, then cast the full tensor
    (kept as ``PerParameterGatherSource`` is)."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.module.named_parameters():
            full = materialize_full_tensor(param.detach())
            wire = self._wire(param.dtype)
            yield name, full if full.dtype == wire else full.to(wire)


class NonSendersBuildTensorsSource(ModuleSource):
    """Baseline: the bucketed gather, but rank 1 builds every full tensor and
    drops it (``ModuleSource`` before ``gather_only``: a rank that does not
    send iterated the whole source)."""

    def gather_only(self) -> Iterator[str]:
        return WeightSource.gather_only(self)  # the default: iterate and drop, skipping ModuleSource's


@dataclass(frozen=True)
class Variant:
    """One measured source: its name, wire dtype, and the dtype the all-gather moves."""

    name: str
    wire: str | None
    make_source: Callable[[torch.nn.Module], ModuleSource]
    gather_dtype: torch.dtype

    @property
    def wire_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.wire) if self.wire else None


BF16 = torch.bfloat16
VARIANTS = (
    Variant("fp32 bucketed", None, ModuleSource, torch.float32),
    Variant("fp32 bucketed, rank 1 builds tensors", None, NonSendersBuildTensorsSource, torch.float32),
    Variant("fp32 per-parameter", None, PerParameterGatherSource, torch.float32),
    Variant("bf16 bucketed", "bfloat16", partial(ModuleSource, dtype=BF16), BF16),
    Variant(
        "bf16 bucketed, rank 1 builds tensors", "bfloat16", partial(NonSendersBuildTensorsSource, dtype=BF16), BF16
    ),
    Variant("bf16 per-parameter", "bfloat16", partial(PerParameterGatherSource, dtype=BF16), BF16),
    Variant("bf16 gather-then-cast", "bfloat16", partial(GatherThenCastSource, dtype=BF16), torch.float32),
)
RAW_DTYPES = (torch.float32, BF16)


@dataclass(frozen=True)
class RankArgs:
    """What every spawned rank needs (picklable)."""

    params_text: str
    rounds: int
    timeout_s: float
    torch_threads: int
    pg_port: int
    receiver_url: str
    other_pids: tuple[int, ...]
    rows_path: str


# --------------------------------------------------------------------------- #
# The trainer ranks
# --------------------------------------------------------------------------- #


def sharded_model(shape: ModelShape, seed: int, mesh: Any) -> torch.nn.Module:
    """The synthetic model (identical on every rank), FSDP2-sharded per decoder layer and at the root."""
    from torch.distributed.fsdp import fully_shard

    model = build_model(shape, seed)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def next_round(go: bool) -> bool:
    """Rank 0 decides whether another round runs; a barrier too, so both ranks start it together.

    Rank 1 passes ``True``: the minimum over ranks is rank 0's decision.
    """
    flag = torch.tensor([int(go)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def drive_rounds(engine: Any, rank: int, planned: int, tag: str) -> list[dict[str, Any]]:
    """``send_weights`` rounds until rank 0 has run ``planned`` of them; each rank's ``last_stats``."""
    stats: list[dict[str, Any]] = []
    while next_round(rank != 0 or len(stats) < planned):
        engine.send_weights(f"{tag} #{len(stats)}")
        stats.append(asdict(engine.last_stats))
    return stats


def visit(variant: Variant, model: torch.nn.Module, rank: int, args: RankArgs, meter_pids: list[int]) -> dict[str, Any]:
    """``trainer_init``, one warm-up round, then one timed round of ``variant``; this rank's stats.

    The warm-up takes the engine's first-round costs (packing buffers are
    allocated and page-faulted in) out of the timed round. ``meter_pids``:
    this benchmark's other processes, whose CPU time is not "other load".
    """
    source = variant.make_source(model)
    client = HTTPVLLMWeightSyncClient(args.receiver_url, timeout=args.timeout_s)  # only rank 0 calls it
    try:
        engine = WeightTransferTrainerFactory.trainer_init(
            "torch_dist",
            {"dtype": variant.wire, "timeout_s": args.timeout_s},
            {"master_address": LOOPBACK, "master_port": 0, "rank": rank},
            client=client,
            source=source,
        )
        try:
            if type(engine.source) is not type(source):
                raise TypeError(f"{variant.name}: the engine replaced the source by {type(engine.source).__name__}")
            drive_rounds(engine, rank, 1, f"{variant.name} warm-up")
            with CpuLoadMeter(*meter_pids) as load:
                (stats,) = drive_rounds(engine, rank, 1, variant.name)
                dist.barrier()
                start = time.perf_counter()
                # As in a round: rank 0 produces the tensors, rank 1 only joins the gathers.
                for _ in engine.source.iter_uncast() if rank == 0 else engine.source.gather_only():
                    pass
                pass_s = time.perf_counter() - start
        finally:
            engine.shutdown()
    finally:
        client.close()
    return {**stats, "source": type(engine.source).__name__, "gather_pass_s": pass_s, "other_cpu_cores": load.other_cores}


def raw_all_gather_seconds(model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int | None) -> tuple[float, int]:
    """Seconds of ``all_gather_into_tensor`` over the model's shards (cast to
    ``dtype``, each padded to the largest rank's, packed beforehand) into
    warm preallocated outputs, nothing else timed. ``bucket_bytes``: the
    shards back to back, gathered in calls of that many full bytes (what
    ``FSDP2Shards`` sends per call); ``None``: one call per tensor.
    Returns the seconds and the bytes gathered."""
    from wt_callbacks.transfer.sources.fsdp2 import _all_gather

    world = dist.get_world_size()
    shards = []
    for param in model.parameters():
        local = param.detach().to_local().to(dtype).reshape(-1)
        rows = -(-param.shape[0] // world)
        padded = torch.zeros(rows * (param.numel() // max(param.shape[0], 1)), dtype=dtype)
        padded[: local.numel()].copy_(local)
        shards.append(padded)
    if bucket_bytes is None:
        inputs = shards
    else:
        flat = torch.cat(shards)
        inputs = list(flat.split(max(1, bucket_bytes // world // dtype.itemsize)))
    outputs = [torch.empty(t.numel() * world, dtype=dtype) for t in inputs]
    for out, inp in zip(outputs, inputs):  # warm: page the outputs in, as FSDP2Shards keeps its buffers
        _all_gather(out, inp)
    dist.barrier()
    start = time.perf_counter()
    for out, inp in zip(outputs, inputs):
        _all_gather(out, inp)
    return time.perf_counter() - start, sum(o.numel() for o in outputs) * dtype.itemsize


def checksum_verdict(variant: Variant, model: torch.nn.Module, rank: int, args: RankArgs) -> dict[str, Any]:
    """The receiver's checksums against the gathered ``model`` rounded through the wire dtype (on rank 0)."""
    expected = module_checksums(model, via_dtype=variant.wire_dtype)  # all-gathers: every rank
    if rank != 0:
        return {}
    got = receiver_checksums(args.receiver_url, args.timeout_s)
    mismatched = sorted(n for n in expected if got.get(n) != expected[n]) + sorted(set(got) - set(expected))
    return {"passed": not mismatched, "mismatched": len(mismatched), "first_mismatched": mismatched[:5]}


def summary(variant: Variant, model: torch.nn.Module, rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One source's row from ``rounds[rank][i]``, the stats of every rank's timed rounds."""
    ours, rank1 = rounds[0], rounds[1]
    seconds = [r["seconds"] for r in ours]
    gathers = [r["gather_seconds"] for r in ours]
    return {
        "name": variant.name,
        "wire": variant.wire or "float32",
        "gather_dtype": str(variant.gather_dtype).removeprefix("torch."),
        "source": ours[-1]["source"],
        "rounds": ours,
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "median_gather_s": statistics.median(gathers),
        "min_gather_s": min(gathers),
        "median_gather_pass_s": statistics.median(r["gather_pass_s"] for r in ours),
        "bytes": ours[-1]["bytes"],
        "gathered_bytes": sum(p.numel() for p in model.parameters()) * variant.gather_dtype.itemsize,
        "rank1_median_s": statistics.median(r["seconds"] for r in rank1),
        "rank1_median_gather_s": statistics.median(r["gather_seconds"] for r in rank1),
        "other_cpu_cores": statistics.fmean(r["other_cpu_cores"] for r in ours),
    }


def rank_main(rank: int, args: RankArgs) -> None:
    """One trainer rank: ``args.rounds`` cycles over the sources; rank 0 writes the rows to ``args.rows_path``.

    Each cycle runs one timed round of every source, so a change in the
    machine's load (it may be shared) hits all sources alike instead of
    whichever happened to run at the time.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{LOOPBACK}:{args.pg_port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    try:
        pids: list[Any] = [None] * WORLD_SIZE
        dist.all_gather_object(pids, os.getpid())
        meter_pids = [*args.other_pids, *(pid for r, pid in enumerate(pids) if r != rank)]
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        shape = shape_for(parse_size(args.params_text))
        # A seed per source: a passing checksum proves that source's round reached the receiver.
        models = [sharded_model(shape, TRAINER_SEED + 1 + i, mesh) for i in range(len(VARIANTS))]
        stats: list[list[dict[str, Any]]] = [[] for _ in VARIANTS]
        raw: dict[str, list[float]] = {}
        raw_bytes: dict[str, int] = {}
        verdicts: list[dict[str, Any]] = []
        for cycle in range(args.rounds):
            for variant, model, timed in zip(VARIANTS, models, stats):
                timed.append(visit(variant, model, rank, args, meter_pids))
                if cycle == args.rounds - 1:
                    verdicts.append(checksum_verdict(variant, model, rank, args))
            for dtype in RAW_DTYPES:
                for layout, bucket in (("bucketed", DEFAULT_GATHER_BUCKET_BYTES), ("per-tensor", None)):
                    key = f"{str(dtype).removeprefix('torch.')} {layout}"
                    seconds, raw_bytes[key] = raw_all_gather_seconds(models[0], dtype, bucket)
                    raw.setdefault(key, []).append(seconds)
        per_rank: list[Any] = [None] * WORLD_SIZE
        dist.all_gather_object(per_rank, stats)
        if rank == 0:
            rows = [
                {**summary(v, m, [per_rank[r][i] for r in range(WORLD_SIZE)]), "checksum": verdict}
                for i, (v, m, verdict) in enumerate(zip(VARIANTS, models, verdicts))
            ]
            raw_rows = {
                key: {"median_s": statistics.median(v), "min_s": min(v), "all_s": v, "bytes": raw_bytes[key]}
                for key, v in raw.items()
            }
            Path(args.rows_path).write_text(json.dumps({"rows": rows, "raw_all_gather": raw_rows}))
    finally:
        leave_group_together()


# --------------------------------------------------------------------------- #
# The driver
# --------------------------------------------------------------------------- #


def run_ranks(args: RankArgs, budget_s: float) -> None:
    """Spawn the ranks and wait at most ``budget_s``; on timeout kill them by PID and raise.

    A rank that fails makes ``join`` terminate the other one and raise.
    """
    context = mp.start_processes(rank_main, args=(args,), nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + budget_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the trainer ranks did not finish within {budget_s:g} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)


def ratio(rows: list[dict[str, Any]], key: str, num: str, den: str) -> float:
    """``rows[num][key] / rows[den][key]``, rows looked up by name."""
    by_name = {r["name"]: r for r in rows}
    return by_name[num][key] / by_name[den][key]


def gather_ratios(rows: list[dict[str, Any]], raw: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per source: gathered-bytes throughput of its round's gather and of its
    gather-only pass, as a fraction of the raw bucketed all-gather's in the
    dtype it gathers (medians of the same run)."""
    out = {}
    for r in rows:
        ceiling = raw[f"{r['gather_dtype']} bucketed"]
        raw_rate = ceiling["bytes"] / ceiling["median_s"]
        out[r["name"]] = {
            "round_gather_vs_raw": r["gathered_bytes"] / r["median_gather_s"] / raw_rate,
            "gather_pass_vs_raw": r["gathered_bytes"] / r["median_gather_pass_s"] / raw_rate,
        }
    return out


def markdown_table(result: dict[str, Any]) -> str:
    """One row per source, the raw all-gathers, then the ratios."""
    m = result["model"]
    lines = [
        f"FSDP2, {WORLD_SIZE} ranks, synthetic Llama fp32: {m['params'] / 1e6:.1f}M params (hidden {m['hidden']}, "
        f"{m['layers']} layers, vocab {m['vocab']}, {m['tensors']} tensors); {result['rounds']} timed rounds per source, "
        f"interleaved, each after its own trainer_init and warm-up round; {result['torch_threads']} torch thread(s) per process; load average "
        f"{result['machine']['loadavg_before'][0]:.2f} before, {result['machine']['loadavg_after'][0]:.2f} after.",
        "",
        "| source | wire MB | gathered MB | median s | min s | wire GB/s | median gather s | gather vs raw "
        "| gather-only pass s | pass vs raw | rank 1 median s | checksum | other load (cores) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    q = result["ratios"]
    for r in result["rows"]:
        g = q["vs_raw_all_gather"][r["name"]]
        lines.append(
            f"| {r['name']} | {r['bytes'] / 1e6:.0f} | {r['gathered_bytes'] / 1e6:.0f} | {r['median_s']:.3f} | "
            f"{r['min_s']:.3f} | {r['bytes'] / r['median_s'] / GB:.2f} | {r['median_gather_s']:.3f} | "
            f"{g['round_gather_vs_raw']:.0%} | {r['median_gather_pass_s']:.3f} | {g['gather_pass_vs_raw']:.0%} | "
            f"{r['rank1_median_s']:.3f} | {'pass' if r['checksum']['passed'] else 'FAIL'} | {r['other_cpu_cores']:.2f} |"
        )
    lines += ["", "| raw all_gather_into_tensor | MB | median s | min s | GB/s |", "|---|---:|---:|---:|---:|"]
    for key, raw in result["raw_all_gather"].items():
        lines.append(
            f"| {key} | {raw['bytes'] / 1e6:.0f} | {raw['median_s']:.3f} | {raw['min_s']:.3f} | "
            f"{raw['bytes'] / raw['median_s'] / GB:.2f} |"
        )
    lines += [
        "",
        f"bucketed / per-parameter gather speed: fp32 {q['gather_per_parameter_over_bucketed']['fp32']:.2f}x, "
        f"bf16 {q['gather_per_parameter_over_bucketed']['bf16']:.2f}x (round "
        f"{q['round_per_parameter_over_bucketed']['fp32']:.2f}x, {q['round_per_parameter_over_bucketed']['bf16']:.2f}x); "
        f"gather-then-cast / cast-before-gather (bucketed): round {q['round_gather_then_cast_over_cast_before_gather']:.2f}x, "
        f"gather {q['gather_gather_then_cast_over_cast_before_gather']:.2f}x; "
        f"rank 1 building the tensors / only gathering: round {q['round_rank1_builds_tensors_over_gather_only']['fp32']:.2f}x "
        f"(fp32), {q['round_rank1_builds_tensors_over_gather_only']['bf16']:.2f}x (bf16)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="100M", help="target parameter count, e.g. 100M or 2M (default 100M)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per source (default 5)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/fsdp2_gather.json")
    parser.add_argument("--timeout", type=float, default=120.0, help="bound in seconds on every wait")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads of each rank and of the receiver (default 1: three processes share the "
        "machine; 0 keeps torch's default)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")

    shape = shape_for(parse_size(args.params))
    with torch.device("meta"):
        params = list(SyntheticLlama(shape).parameters())
    print(f"model: {sum(p.numel() for p in params) / 1e6:.1f}M params, {shape}", flush=True)
    loadavg_before = os.getloadavg()
    print(f"load average before: {loadavg_before}", flush=True)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wt-fsdp2-") as tmp:
        with start_synthetic_receiver(args.params, torch_threads=args.torch_threads, timeout_s=args.timeout) as receiver:
            print(f"receiver (pid {receiver.proc.pid}) on {receiver.url}", flush=True)
            rank_args = RankArgs(
                params_text=args.params,
                rounds=args.rounds,
                timeout_s=args.timeout,
                torch_threads=args.torch_threads,
                pg_port=free_port(),
                receiver_url=receiver.url,
                other_pids=(receiver.proc.pid, os.getpid()),
                rows_path=str(Path(tmp) / "rows.json"),
            )
            # Each rank's waits are bounded by --timeout; this bounds the whole run
            # generously: every trainer_init, round, model build and checksum pass may take one.
            budget_s = args.timeout * (len(VARIANTS) * (3 * args.rounds + 2) + 2)
            try:
                run_ranks(rank_args, budget_s)
            except BaseException:
                print(f"receiver log:\n{receiver.log[-3000:]}", file=sys.stderr)
                raise
        measured = json.loads(Path(rank_args.rows_path).read_text())
    rows, raw = measured["rows"], measured["raw_all_gather"]

    result = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_before": loadavg_before,
            "loadavg_after": os.getloadavg(),
        },
        "model": {
            "params": sum(p.numel() for p in params),
            "tensors": len(params),
            "largest_tensor_bytes": max(p.numel() * p.element_size() for p in params),
            **vars(shape),
        },
        "world_size": WORLD_SIZE,
        "rounds": args.rounds,
        "torch_threads": args.torch_threads,
        "packed_buffer_size_bytes": DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        "gather_bucket_bytes": DEFAULT_GATHER_BUCKET_BYTES,
        "rows": rows,
        "raw_all_gather": raw,
        "ratios": {
            "vs_raw_all_gather": gather_ratios(rows, raw),
            "gather_per_parameter_over_bucketed": {
                w: ratio(rows, "median_gather_s", f"{w} per-parameter", f"{w} bucketed") for w in ("fp32", "bf16")
            },
            "round_per_parameter_over_bucketed": {
                w: ratio(rows, "median_s", f"{w} per-parameter", f"{w} bucketed") for w in ("fp32", "bf16")
            },
            "round_rank1_builds_tensors_over_gather_only": {
                w: ratio(rows, "median_s", f"{w} bucketed, rank 1 builds tensors", f"{w} bucketed")
                for w in ("fp32", "bf16")
            },
            "round_gather_then_cast_over_cast_before_gather": ratio(
                rows, "median_s", "bf16 gather-then-cast", "bf16 bucketed"
            ),
            "gather_gather_then_cast_over_cast_before_gather": ratio(
                rows, "median_gather_s", "bf16 gather-then-cast", "bf16 bucketed"
            ),
        },
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(markdown_table(result))
    print(f"\nwrote {args.out}")
    failed = [r["name"] for r in rows if not r["checksum"]["passed"]]
    return checksum_exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
