"""Trainer -> receiver weight-sync throughput of the ``torch_dist`` backend over loopback.

Run from the repository root (about 10 minutes on 2 cores)::

    python benchmarks/transfer_throughput.py --out benchmarks/results/transfer.json

What it does:

1. Measures the ceilings: raw TCP throughput over 127.0.0.1 from this
   process to a child process that ``recv_into``'s a reused buffer,
   memcpy bandwidth, and the shm ring's own copies on an fp32 and a bf16
   wire (the floor of the bf16 / fp32 ratio over shm).
2. For each ``--params`` size (default 50M, 200M, 500M) builds a seeded,
   Llama-shaped fp32 model (``wt_callbacks.demos.synthetic_llama``) and
   starts the reference receiver in a separate process serving the same
   shape from another seed (``--module-factory
   wt_callbacks.demos.synthetic_llama:receiver_model``), so a passing
   checksum proves the weights really travelled.
3. For every configuration (``sync_configs``: packed 64 MiB / 256 MiB / 1 GiB
   buckets with 2 and 1 buffers, unpacked, fp32 and bf16 wires, each host
   transport) it re-seeds the trainer model, runs ``trainer_init``, one
   warm-up round while sampling this process's RSS every ~1 ms, and
   ``--rounds`` timed ``send_weights``, then compares the receiver's
   ``GET /weight_checksums`` with ``module_checksums(model, via_dtype=...)``.
4. The alternatives, over the same receiver: the per-parameter way (one
   ``update_weights`` call and one broadcast per tensor, as TRL's classic
   client does) and the disk way (write safetensors, then the receiver's
   ``reload_weights`` RPC loads them).

Output: JSON (``--out``), the same results as a markdown report (``.md``
next to it) and a plot of throughput vs model size per method (``.png``).
The exit status is 1 if any checksum differs. GB are 10^9 bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from wt_callbacks.demos.receiver_process import ReceiverProcess
from wt_callbacks.demos.synthetic_llama import TRAINER_SEED, build_model, parse_size, reseed, shape_for

from harness import GB, MiB, CpuLoadMeter, RssSampler, TimedClient, checksum_exit_status, start_synthetic_receiver

REPO_ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"


# --------------------------------------------------------------------------- #
# The TCP ceiling
# --------------------------------------------------------------------------- #


def _tcp_sink(port: int, total_bytes: int, block_bytes: int, trials: int, timeout_s: float) -> None:
    """Child process: receive ``total_bytes`` ``trials`` times, acking each with one byte."""
    buffer = memoryview(bytearray(block_bytes))
    with socket.create_connection((LOOPBACK, port), timeout=timeout_s) as sock:
        for _ in range(trials):
            received = 0
            while received < total_bytes:
                n = sock.recv_into(buffer, min(block_bytes, total_bytes - received))
                if n == 0:
                    raise ConnectionError("the sender closed the connection early")
                received += n
            sock.sendall(b"\x01")


def measure_memcpy(total_bytes: int, trials: int = 3) -> dict[str, Any]:
    """Host memory bandwidth: best of ``trials`` copies between two warm buffers."""
    src = torch.ones(total_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault both buffers in before timing
    seconds = []
    for _ in range(trials):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    return {"bytes": total_bytes, "best_s": min(seconds), "gbps": total_bytes / min(seconds) / GB}


def measure_ring_copy_floor(total_bytes: int, trials: int = 3) -> dict[str, Any]:
    """The shm ring's own copies for an fp32 model of ``total_bytes``, on an
    fp32 and on a bf16 wire, one thread per side as the ring has: the
    trainer's copy of every piece from the model into a slot (``memmove``;
    for bf16 ``copy_`` converting) and the receiver's copy out of a slot
    into an fp32 model. Each side alone, then both at once (as in a round,
    where they share the memory bus). Best of ``trials``.

    The ring (``SHM_SLOTS`` x ``SHM_SLOT_BYTES``, 16 MiB) fits in the CPU's
    last-level cache, so the bytes a bf16 wire saves are cache traffic: in
    main memory the trainer still reads, and the receiver still writes, 4
    bytes per parameter. ``both_bf16_over_fp32`` is the floor of a bf16
    wire's time over the fp32 wire's into an fp32 receiver over shm, every
    fixed cost of a round left out.
    """
    from wt_callbacks.transfer.backends.torch_dist.shm_ring import SHM_SLOT_BYTES, SHM_SLOTS

    elements = total_bytes // 4 // SHM_SLOT_BYTES * SHM_SLOT_BYTES  # whole fp32 slots and whole bf16 slots
    model, received = torch.randn(elements), torch.empty(elements)
    ring = torch.zeros(2 * SHM_SLOTS * SHM_SLOT_BYTES, dtype=torch.uint8)  # a ring per side: no races when at once

    def copy_through_ring(itemsize: int, side: int) -> None:
        """Side 0 copies the model into its ring, side 1 its ring into ``received``."""
        wire = torch.float32 if itemsize == 4 else torch.bfloat16
        per_slot = SHM_SLOT_BYTES // itemsize
        for piece, first in enumerate(range(0, elements, per_slot)):
            start = (side * SHM_SLOTS + piece % SHM_SLOTS) * SHM_SLOT_BYTES
            slot = ring[start : start + SHM_SLOT_BYTES].view(wire)
            weights = (model if side == 0 else received)[first : first + per_slot]
            target, source = (slot, weights) if side == 0 else (weights, slot)
            if itemsize == 4:
                ctypes.memmove(target.data_ptr(), source.data_ptr(), SHM_SLOT_BYTES)
            else:
                target.copy_(source)

    def both(itemsize: int) -> None:
        other = threading.Thread(target=copy_through_ring, args=(itemsize, 1))
        other.start()
        copy_through_ring(itemsize, 0)
        other.join()

    sides = (
        ("trainer", lambda itemsize: copy_through_ring(itemsize, 0)),
        ("receiver", lambda itemsize: copy_through_ring(itemsize, 1)),
        ("both", both),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ring's threads copy single-threaded; so does each thread here
    best: dict[str, float] = {}
    try:
        for name, copy in sides:
            for wire_name, itemsize in (("fp32", 4), ("bf16", 2)):
                copy(itemsize)  # fault the buffers in
                seconds = []
                for _ in range(trials):
                    began = time.perf_counter()
                    copy(itemsize)
                    seconds.append(time.perf_counter() - began)
                best[f"{name}_{wire_name}_s"] = min(seconds)
            best[f"{name}_bf16_over_fp32"] = best[f"{name}_bf16_s"] / best[f"{name}_fp32_s"]
    finally:
        torch.set_num_threads(threads)  # the rounds that follow run on --torch-threads
    return {"model_bytes": elements * 4, "ring_bytes": SHM_SLOTS * SHM_SLOT_BYTES, **best}


def measure_tcp_ceiling(total_bytes: int, block_bytes: int, trials: int, timeout_s: float) -> dict[str, Any]:
    """Raw loopback TCP throughput from this process to a child process.

    The parent ``sendall``'s ``total_bytes`` in ``block_bytes`` blocks; the
    clock stops when the child acknowledges the last byte. The best of
    ``trials`` is the ceiling.
    """
    ctx = multiprocessing.get_context("spawn")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((LOOPBACK, 0))
        listener.listen(1)
        listener.settimeout(timeout_s)
        child = ctx.Process(
            target=_tcp_sink,
            args=(listener.getsockname()[1], total_bytes, block_bytes, trials, timeout_s),
            daemon=True,
        )
        child.start()
        try:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(timeout_s)
                payload = memoryview(bytearray(os.urandom(1024)) * (block_bytes // 1024))
                seconds = []
                for _ in range(trials):
                    start = time.perf_counter()
                    remaining = total_bytes
                    while remaining:
                        n = min(block_bytes, remaining)
                        conn.sendall(payload[:n])
                        remaining -= n
                    if conn.recv(1) != b"\x01":
                        raise ConnectionError("the TCP sink did not acknowledge the transfer")
                    seconds.append(time.perf_counter() - start)
        finally:
            child.join(timeout=timeout_s)
            if child.is_alive():
                child.kill()
                child.join(timeout=10)
    best = min(seconds)
    return {
        "bytes": total_bytes,
        "block_bytes": block_bytes,
        "trial_seconds": seconds,
        "best_seconds": best,
        "gbps": total_bytes / best / GB,
    }


def cast_in_source(model: nn.Module) -> Any:
    """Baseline source: every plain parameter is cast into a fresh tensor
    before the transport copies it, as ``ModuleSource`` did before the
    packing learnt to cast as it copies (``WeightSource.iter_uncast``)."""
    from wt_callbacks.transfer import ModuleSource

    class CastInSource(ModuleSource):
        def iter_uncast(self) -> Any:
            for name, tensor in super().iter_uncast():
                wire = self._wire(tensor.dtype)
                yield name, tensor if tensor.dtype == wire else tensor.to(wire)

    return CastInSource(model)


def module_source(model: nn.Module) -> Any:
    from wt_callbacks.transfer import ModuleSource

    return ModuleSource(model)


SOURCES = {"": module_source, "cast-in-source": cast_in_source}
"""Source of a configuration by its name suffix: the library's ``ModuleSource``, or a baseline."""


@dataclass(frozen=True)
class Setup:
    """One measured configuration: a name, the trainer config dict and the source (a ``SOURCES`` key)."""

    name: str
    config: dict[str, Any]
    source: str = ""

    @property
    def wire_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.config["dtype"]) if self.config.get("dtype") else None


BUCKETS = {"64MiB": 64 * MiB, "256MiB": 256 * MiB, "1GiB": 1024 * MiB}
DTYPES = {"fp32": None, "bf16": "bfloat16"}


def transports() -> list[str]:
    """The host transports this version of the backend offers (gloo, and shm where it exists)."""
    from wt_callbacks.transfer.backends.torch_dist import TRANSPORTS

    return [t for t in ("gloo", "shm") if t in TRANSPORTS]


def sync_configs(timeout_s: float) -> list[Setup]:
    """The measured configurations, what the shipped default picks here first.

    fp32 wire: packed with 64 MiB / 256 MiB / 1 GiB buckets, each with 2 and
    with 1 buffer, and unpacked; bf16 wire: packed 64 MiB / 256 MiB x 2 and
    unpacked. On gloo (TCP), and the packed default again on every other host
    transport the backend has. The transport is always explicit, so what a
    row measures does not depend on what ``auto`` picks.
    """
    default = {"packed": True, "packed_buffer_size_bytes": 64 * MiB, "packed_num_buffers": 2}
    layouts: list[tuple[str, str, dict[str, Any]]] = [
        (f"packed {bucket} x{n}", wire, {"packed": True, "packed_buffer_size_bytes": size, "packed_num_buffers": n})
        for wire, buckets, counts in (("fp32", BUCKETS, (2, 1)), ("bf16", ("64MiB", "256MiB"), (2,)))
        for bucket in buckets
        for size in (BUCKETS[bucket],)
        for n in counts
    ]
    layouts += [("unpacked", wire, {"packed": False}) for wire in ("fp32", "bf16")]
    setups = [
        Setup(f"{layout} {wire} gloo", {**cfg, "transport": "gloo", "dtype": DTYPES[wire], "timeout_s": timeout_s})
        for layout, wire, cfg in layouts
    ]
    for transport in transports()[1:]:
        setups += [
            Setup(f"packed 64MiB x2 {wire} {transport}", {**default, "transport": transport, "dtype": DTYPES[wire], "timeout_s": timeout_s})
            for wire in ("fp32", "bf16")
        ]
    # The bf16 wire with the cast where it was before (a temporary per tensor):
    # the before/after of casting as the packing copies.
    setups += [
        Setup(f"packed 64MiB x2 bf16 {transport} cast-in-source",
              {**default, "transport": transport, "dtype": "bfloat16", "timeout_s": timeout_s}, "cast-in-source")
        for transport in transports()
    ]  # fmt: skip
    return sorted(setups, key=lambda setup: setup.name != default_config(transports()[-1]))


def selected_configs(timeout_s: float, patterns: str) -> list[Setup]:
    """``sync_configs`` whose name contains one of the comma-separated ``patterns``
    (all when empty); the default layout's rows always, the summary needs them."""
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    defaults = {default_config(t) for t in transports()}
    return [s for s in sync_configs(timeout_s) if not wanted or s.name in defaults or any(w in s.name for w in wanted)]


def default_config(transport: str) -> str:
    """The row of ``TorchDistTrainerConfig()``'s layout on ``transport`` (``auto``
    picks shm here, the receiver being on 127.0.0.1, where the backend has it)."""
    return f"packed 64MiB x2 fp32 {transport}"



def rss_bound(model: nn.Module, sync: Setup) -> int:
    """``num_buffers x packed_buffer_size_bytes + largest tensor bytes`` (on the wire dtype)."""
    wire = sync.wire_dtype
    largest = max(p.numel() * (wire or p.dtype).itemsize for p in model.parameters())
    if not sync.config["packed"]:
        return largest
    return sync.config["packed_num_buffers"] * sync.config["packed_buffer_size_bytes"] + largest


def run_config(
    model: nn.Module, receiver: ReceiverProcess, sync: Setup, *, rounds: int, seed: int, timeout_s: float
) -> dict[str, Any]:
    """Warm-up (RSS-sampled), ``rounds`` timed rounds, then the checksum check: one visit of ``sync``."""
    from wt_callbacks.checksums import module_checksums
    from wt_callbacks.transfer import WeightTransferTrainerFactory

    reseed(model, seed)
    client = TimedClient(receiver.url, timeout=timeout_s)
    init_info = {"master_address": LOOPBACK, "master_port": 0, "rank": 0}
    try:
        engine = WeightTransferTrainerFactory.trainer_init(
            "torch_dist", sync.config, init_info, client=client, source=SOURCES[sync.source](model)
        )
        try:
            # The first round is the warm-up, RSS-sampled: it allocates the
            # buffers the engine then keeps, so its peak is the memory cost.
            with RssSampler() as rss:
                engine.send_weights("v")
            rss_round_s = engine.last_stats.seconds
            timed = []
            with CpuLoadMeter(receiver.proc.pid) as load:
                for _ in range(rounds):
                    engine.send_weights("v")
                    timed.append({**vars(engine.last_stats), **{f"{k}_s": v for k, v in client.call_seconds.items()}})
        finally:
            engine.shutdown()
    finally:
        client.close()
    expected = module_checksums(model, via_dtype=sync.wire_dtype)
    got = receiver.checksums(timeout_s)
    mismatched = sorted(name for name in expected if got.get(name) != expected[name])
    mismatched += sorted(set(got) - set(expected))
    return {
        "rounds": timed,
        "other_cpu_cores": load.other_cores,
        "rss": {"baseline_bytes": rss.baseline, "peak_extra_bytes": rss.extra, "samples": rss.samples,
                "round_seconds": rss_round_s},  # fmt: skip
        "checksum": {"passed": not mismatched, "mismatched": len(mismatched), "first_mismatched": mismatched[:5]},
    }


def summarize_config(model: nn.Module, sync: Setup, visits: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's row from its visits (``run_config`` results, one per cycle)."""
    timed = [r for v in visits for r in v["rounds"]]
    seconds = [r["seconds"] for r in timed]
    sent = timed[-1]["bytes"]
    bound = rss_bound(model, sync)
    worst_rss = max(visits, key=lambda v: v["rss"]["peak_extra_bytes"])["rss"]
    failed = [v["checksum"] for v in visits if not v["checksum"]["passed"]]
    return {
        "name": sync.name,
        "config": sync.config,
        "source": sync.source or "ModuleSource",
        "bytes": sent,
        "tensors": timed[-1]["tensors"],
        "visits": len(visits),
        "rounds": timed,
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "gbps_median": sent / statistics.median(seconds) / GB,
        "gbps_best": sent / min(seconds) / GB,
        "median_gather_s": statistics.median(r["gather_seconds"] for r in timed),
        "median_call_s": {
            call: statistics.median(r[f"{call}_s"] for r in timed)
            for call in ("start_weight_update", "update_weights", "finish_weight_update")
        },
        "other_cpu_cores": statistics.fmean(v["other_cpu_cores"] for v in visits),
        "rss": {**worst_rss, "bound_bytes": bound, "ratio_to_bound": worst_rss["peak_extra_bytes"] / bound},
        "checksum": failed[0] if failed else visits[-1]["checksum"],
    }


def run_per_parameter(model: nn.Module, receiver: ReceiverProcess, *, rounds: int, timeout_s: float) -> dict[str, Any]:
    """The per-parameter way (TRL's classic client): one ``update_weights``
    call and one broadcast per tensor, each call answered before the next.

    It reuses an unpacked engine's group and client for the transport and
    drives the round by hand, so the only difference from ``unpacked`` is the
    control call per tensor.
    """
    from concurrent.futures import ThreadPoolExecutor

    from wt_callbacks.transfer import ModuleSource, WeightTransferTrainerFactory
    from wt_callbacks.transfer.backends.torch_dist import update_info_for

    source = ModuleSource(model)
    metas = source.metadata()
    client = TimedClient(receiver.url, timeout=timeout_s)
    engine = WeightTransferTrainerFactory.trainer_init(
        "torch_dist",
        # gloo as for the configurations it is compared with.
        {"packed": False, "transport": "gloo", "timeout_s": timeout_s},
        {"master_address": LOOPBACK, "master_port": 0, "rank": 0},
        client=client,
        source=source,
    )
    seconds = []
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            for _ in range(rounds + 1):  # the first is the warm-up
                start = time.perf_counter()
                client.start_weight_update()
                for meta, (_, tensor) in zip(metas, source):
                    call = pool.submit(client.update_weights, update_info_for([meta], session_id=engine.session_id))
                    engine.group.broadcast(tensor.contiguous()).wait()
                    call.result(timeout=timeout_s)
                client.finish_weight_update("v")
                seconds.append(time.perf_counter() - start)
    finally:
        engine.shutdown()
        client.close()
    from wt_callbacks.checksums import module_checksums

    timed = seconds[1:]
    sent = sum(m.nbytes for m in metas)
    return {
        "name": "per-parameter calls fp32 gloo",
        "bytes": sent,
        "tensors": len(metas),
        "checksum_passed": receiver.checksums(timeout_s) == module_checksums(model),
        "median_s": statistics.median(timed),
        "min_s": min(timed),
        "gbps_median": sent / statistics.median(timed) / GB,
    }


def run_disk(
    model: nn.Module, receiver: ReceiverProcess, *, rounds: int, timeout_s: float, directory: Path | None
) -> dict[str, Any]:
    """The disk way: write the weights as safetensors, then have the receiver
    load them (``POST /collective_rpc`` ``reload_weights``, vLLM's reload RPC).

    Nothing is fsync'ed, so the load reads from the page cache of this
    machine: the most favourable case for the disk. Across machines it would
    also need a shared filesystem.
    """
    import requests
    from safetensors.torch import save_file

    from wt_callbacks.checksums import module_checksums

    rows = []
    with tempfile.TemporaryDirectory(prefix="wt-disk-", dir=directory) as tmp:
        for _ in range(rounds + 1):  # the first is the warm-up
            start = time.perf_counter()
            save_file({name: p.detach() for name, p in model.named_parameters()}, Path(tmp) / "model.safetensors")
            saved = time.perf_counter()
            reply = requests.post(
                f"{receiver.url}/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": tmp}},
                timeout=timeout_s,
            )
            reply.raise_for_status()
            rows.append({"save_s": saved - start, "load_s": time.perf_counter() - saved, "seconds": time.perf_counter() - start})
        filesystem = _filesystem_of(Path(tmp))
    timed = rows[1:]
    sent = sum(p.numel() * p.element_size() for p in model.parameters())
    median = statistics.median(r["seconds"] for r in timed)
    return {
        "name": "disk: safetensors write + receiver reload fp32",
        "bytes": sent,
        "filesystem": filesystem,
        "rounds": timed,
        "median_s": median,
        "min_s": min(r["seconds"] for r in timed),
        "median_save_s": statistics.median(r["save_s"] for r in timed),
        "median_load_s": statistics.median(r["load_s"] for r in timed),
        "gbps_median": sent / median / GB,
        "checksum_passed": receiver.checksums(timeout_s) == module_checksums(model),
    }


def _filesystem_of(path: Path) -> str:
    """The filesystem type holding ``path`` (from /proc/mounts; "tmpfs" means RAM)."""
    best = ("", "unknown")
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount_point, fs_type = line.split()[:3]
            if str(path.resolve()).startswith(mount_point) and len(mount_point) > len(best[0]):
                best = (mount_point, fs_type)
    return best[1]


def run_size(params_text: str, args: argparse.Namespace, tcp_gbps: float) -> dict[str, Any]:
    """Every configuration, the per-parameter way and the disk way for one model size."""
    shape = shape_for(parse_size(params_text))
    model = build_model(shape, TRAINER_SEED)
    params = list(model.parameters())
    print(f"\nmodel {params_text}: {sum(p.numel() for p in params) / 1e6:.1f}M params, {len(params)} tensors, {shape}", flush=True)
    setups = selected_configs(args.timeout, args.configs)
    visits: list[list[dict[str, Any]]] = [[] for _ in setups]
    with start_synthetic_receiver(params_text, torch_threads=args.torch_threads, timeout_s=args.timeout) as receiver:
        print(f"receiver (pid {receiver.proc.pid}) on {receiver.url}", flush=True)
        # Cycles interleave the configurations, so a change of load on a shared
        # machine hits all of them alike.
        for cycle in range(args.cycles):
            for i, sync in enumerate(setups):
                visit = run_config(model, receiver, sync, rounds=args.rounds, seed=TRAINER_SEED + 1 + i, timeout_s=args.timeout)
                visits[i].append(visit)
                seconds = [r["seconds"] for r in visit["rounds"]]
                print(
                    f"  [{cycle}] {sync.name}: median {statistics.median(seconds):.3f} s, other load "
                    f"{visit['other_cpu_cores']:.2f}, checksum {'pass' if visit['checksum']['passed'] else 'FAIL'}",
                    flush=True,
                )
        configs = [summarize_config(model, sync, v) for sync, v in zip(setups, visits)]
        per_parameter = run_per_parameter(model, receiver, rounds=args.rounds, timeout_s=args.timeout)
        print(f"  per-parameter calls: median {per_parameter['median_s']:.3f} s", flush=True)
        disk = run_disk(model, receiver, rounds=args.rounds, timeout_s=args.timeout, directory=args.disk_dir)
        print(f"  disk ({disk['filesystem']}): median {disk['median_s']:.3f} s", flush=True)
    for row in [*configs, per_parameter, disk]:
        row["ratio_to_tcp"] = row["gbps_median"] / tcp_gbps
    return {
        "params_text": params_text,
        "model": {
            "params": sum(p.numel() for p in params),
            "tensors": len(params),
            "largest_tensor_bytes": max(p.numel() * p.element_size() for p in params),
            **vars(shape),
        },
        "configs": configs,
        "per_parameter": per_parameter,
        "disk": disk,
    }


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def size_table(size: dict[str, Any]) -> str:
    """One model size: a row per configuration, then the per-parameter and disk ways."""
    m = size["model"]
    lines = [
        f"#### {m['params'] / 1e6:.0f}M params (hidden {m['hidden']}, {m['layers']} layers, vocab {m['vocab']}, "
        f"{m['tensors']} tensors, largest {m['largest_tensor_bytes'] / MiB:.0f} MiB)",
        "",
        "| config | MB sent | median s | min s | GB/s | vs TCP | gather s | HTTP start+finish s | "
        "peak extra RSS MiB | bound MiB | RSS/bound | checksum | other load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for c in size["configs"]:
        calls = c["median_call_s"]
        lines.append(
            f"| {c['name']} | {c['bytes'] / 1e6:.0f} | {c['median_s']:.3f} | {c['min_s']:.3f} | "
            f"{c['gbps_median']:.2f} | {c['ratio_to_tcp']:.0%} | {c['median_gather_s']:.3f} | "
            f"{calls['start_weight_update'] + calls['finish_weight_update']:.3f} | "
            f"{c['rss']['peak_extra_bytes'] / MiB:.0f} | {c['rss']['bound_bytes'] / MiB:.0f} | "
            f"{c['rss']['ratio_to_bound']:.2f} | {'pass' if c['checksum']['passed'] else 'FAIL'} | "
            f"{c['other_cpu_cores']:.2f} |"
        )
    for way in (size["per_parameter"], size["disk"]):
        extra = f" (write {way['median_save_s']:.3f} + load {way['median_load_s']:.3f}, {way['filesystem']})" if "filesystem" in way else ""
        lines.append(
            f"| {way['name']}{extra} | {way['bytes'] / 1e6:.0f} | {way['median_s']:.3f} | {way['min_s']:.3f} | "
            f"{way['gbps_median']:.2f} | {way['ratio_to_tcp']:.0%} | | | | | | {'pass' if way['checksum_passed'] else 'FAIL'} | |"
        )
    return "\n".join(lines)


def summary_table(result: dict[str, Any]) -> str:
    """Per size and transport, the shipped default layout against the ceilings and the alternatives."""
    lines = [
        "| params | default layout on | s | GB/s | vs TCP | vs memcpy | x per-parameter | x disk | "
        "fastest fp32 config (GB/s) | worst RSS/bound |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for size in result["sizes"]:
        rows = {c["name"]: c for c in size["configs"]}
        fastest = min((c for c in size["configs"] if c["config"]["dtype"] is None), key=lambda c: c["median_s"])
        worst_rss = max(c["rss"]["ratio_to_bound"] for c in size["configs"])
        for transport in transports():
            row = rows[default_config(transport)]
            lines.append(
                f"| {size['model']['params'] / 1e6:.0f}M ({size['model']['tensors']} tensors) | {transport} | "
                f"{row['median_s']:.3f} | {row['gbps_median']:.2f} | {row['ratio_to_tcp']:.0%} | "
                f"{row['gbps_median'] / result['memcpy']['gbps']:.0%} | "
                f"{size['per_parameter']['median_s'] / row['median_s']:.1f}x | "
                f"{size['disk']['median_s'] / row['median_s']:.1f}x | "
                f"{fastest['name']} ({fastest['gbps_median']:.2f}) | {worst_rss:.2f} |"
            )
    return "\n".join(lines)


def bf16_rows(size: dict[str, Any]) -> list[dict[str, Any]]:
    """Per transport: the bf16 wire's time as a fraction of the fp32 wire's
    (default layout, same run), cast as the packing copies and cast in the source."""
    rows = {c["name"]: c for c in size["configs"]}
    out = []
    for transport in transports():
        fp32 = rows[default_config(transport)]
        for label, name in (("cast while packing", f"packed 64MiB x2 bf16 {transport}"),
                            ("cast in the source", f"packed 64MiB x2 bf16 {transport} cast-in-source")):  # fmt: skip
            if name in rows:
                bf16 = rows[name]
                out.append({
                    "transport": transport, "cast": label, "bf16_s": bf16["median_s"], "fp32_s": fp32["median_s"],
                    "ratio": bf16["median_s"] / fp32["median_s"], "rss_ratio_to_bound": bf16["rss"]["ratio_to_bound"],
                    "other_cpu_cores": bf16["other_cpu_cores"],
                })  # fmt: skip
    return out


def bf16_table(result: dict[str, Any]) -> str:
    lines = [
        "| params | transport | bf16 cast | bf16 s | fp32 s | bf16 / fp32 | bf16 RSS/bound | other load |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for size in result["sizes"]:
        for r in bf16_rows(size):
            lines.append(
                f"| {size['model']['params'] / 1e6:.0f}M | {r['transport']} | {r['cast']} | {r['bf16_s']:.3f} | "
                f"{r['fp32_s']:.3f} | {r['ratio']:.2f} | {r['rss_ratio_to_bound']:.2f} | {r['other_cpu_cores']:.2f} |"
            )
    return "\n".join(lines)


def ring_floor_line(floor: dict[str, Any]) -> str:
    """The ring's own copies, bf16 wire over fp32 wire (``measure_ring_copy_floor``)."""
    sides = ", ".join(
        f"{side} {floor[f'{side}_bf16_over_fp32']:.2f} ({floor[f'{side}_bf16_s']:.3f} / {floor[f'{side}_fp32_s']:.3f} s)"
        for side in ("trainer", "receiver", "both")
    )
    return (
        f"The ring's copies alone, {floor['model_bytes'] / 1e6:.0f} MB of fp32 weights, one thread per side, "
        f"bf16 / fp32 wire: {sides} at once. The {floor['ring_bytes'] >> 20} MiB ring stays in the CPU's cache: into an fp32 receiver "
        f"over shm a bf16 wire saves cache traffic, not memory traffic, and `both` is the floor of its ratio."
    )


def markdown_report(result: dict[str, Any]) -> str:
    tcp, memcpy = result["tcp_ceiling"], result["memcpy"]
    head = (
        f"Trainer -> reference receiver process over 127.0.0.1, synthetic Llama fp32 models; "
        f"{result['cycles']} interleaved visit(s) of each configuration, each {result['rounds']} timed rounds after "
        f"trainer_init and 1 warm-up; {result['torch_threads']} torch thread(s) per process; "
        f"{result['machine']['cpus']} CPUs. Ceilings measured in the same run: raw loopback TCP "
        f"{tcp['gbps']:.2f} GB/s ({tcp['bytes'] / 1e6:.0f} MB, best of 3), memcpy {memcpy['gbps']:.2f} GB/s (one core). "
        f"GB = 10^9 bytes; GB/s counts the bytes on the wire (a bf16 wire carries half); "
        f"`other load` = CPU cores used by other processes meanwhile (comparable only near 0).\n"
    )
    parts = [head, "### Summary", "", summary_table(result), "", "### bf16 wire from an fp32 model", "",
             bf16_table(result), "", ring_floor_line(result["ring_copy_floor"]), ""]  # fmt: skip
    for size in result["sizes"]:
        parts += [size_table(size), ""]
    return "\n".join(parts)


def plot(result: dict[str, Any], path: Path) -> None:
    """Throughput vs model size, one line per method, the TCP ceiling dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["sizes"]
    x = [s["model"]["params"] / 1e6 for s in sizes]
    series: dict[str, list[float]] = {}
    for s in sizes:
        for row in [*s["configs"], s["per_parameter"], s["disk"]]:
            series.setdefault(row["name"], []).append(row["gbps_median"])
    shown = [name for name in series if len(series[name]) == len(x)]
    # Every configuration would be unreadable: the default, the 1-buffer and
    # bigger-bucket variants of fp32 packing, unpacked, and the alternatives.
    keep = ("64MiB x2", "1GiB x2", "64MiB x1", "unpacked fp32", "per-parameter", "disk")
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in shown:
        if any(k in name for k in keep) and ("bf16" not in name or "64MiB x2" in name):
            ax.plot(x, series[name], marker="o", label=name)
    ax.axhline(result["tcp_ceiling"]["gbps"], color="black", linestyle="--", label="raw loopback TCP ceiling")
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(x, [f"{v:.0f}M" for v in x])
    ax.set_xlabel("model parameters")
    ax.set_ylabel("GB/s on the wire (median round)")
    ax.set_title("Weight sync, trainer -> receiver process on one host")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--params", default="50M,200M,500M", help="comma-separated model sizes, e.g. 50M,200M,500M (default) or 2M"
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per configuration and cycle (default 5)")
    parser.add_argument(
        "--cycles", type=int, default=1,
        help="visits of every configuration, interleaved (default 1); each visit: trainer_init, warm-up, --rounds",
    )  # fmt: skip
    parser.add_argument(
        "--configs", default="", help="comma-separated substrings: run only the configurations whose name has one "
        "(the default layout's always run), e.g. 'shm' or 'bf16'",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/transfer.json")
    parser.add_argument("--tcp-bytes", default="1G", help="bytes per raw-TCP trial (default 1G = 10^9)")
    parser.add_argument("--timeout", type=float, default=120.0, help="bound in seconds on every wait")
    parser.add_argument("--disk-dir", type=Path, default=None, help="where the disk way writes (default: the temp dir)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads of the trainer and of the receiver (default 1: the two processes share "
        "this machine, and oversubscribed OpenMP copies stall; 0 keeps torch's default)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.cycles < 1:
        parser.error("--rounds and --cycles must be >= 1")
    sizes_text = [text.strip() for text in args.params.split(",") if text.strip()]
    try:
        for text in sizes_text:
            shape_for(parse_size(text))
    except ValueError as e:
        parser.error(f"--params: {e}")
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)

    tcp = measure_tcp_ceiling(parse_size(args.tcp_bytes), 64 * MiB, trials=3, timeout_s=args.timeout)
    print(f"raw TCP ceiling: {tcp['gbps']:.2f} GB/s", flush=True)
    memcpy = measure_memcpy(min(parse_size(args.tcp_bytes), 1 << 30))
    print(f"memcpy: {memcpy['gbps']:.2f} GB/s", flush=True)
    ring_floor = measure_ring_copy_floor(min(parse_size(args.tcp_bytes), 1 << 30))
    print(f"ring copies, bf16 / fp32 wire, both sides at once: {ring_floor['both_bf16_over_fp32']:.2f}", flush=True)

    sizes = [run_size(text, args, tcp["gbps"]) for text in sizes_text]
    result = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_1min_at_end": os.getloadavg()[0],
        },
        "rounds": args.rounds,
        "cycles": args.cycles,
        "torch_threads": torch.get_num_threads(),
        "tcp_ceiling": tcp,
        "memcpy": memcpy,
        "ring_copy_floor": ring_floor,
        "sizes": sizes,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    report = markdown_report(result)
    args.out.with_suffix(".md").write_text(report)
    plot(result, args.out.with_suffix(".png"))
    print()
    print(report)
    print(f"wrote {args.out} and its .md and .png")
    failed = [c["name"] for s in sizes for c in s["configs"] if not c["checksum"]["passed"]]
    failed += [w["name"] for s in sizes for w in (s["per_parameter"], s["disk"]) if not w["checksum_passed"]]
    return checksum_exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
