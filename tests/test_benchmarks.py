"""The benchmark harnesses run at smoke size so they never rot (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT


def run(*args: str) -> None:
    proc = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_transfer_throughput_smoke(tmp_path):
    out = tmp_path / "transfer.json"
    run("benchmarks/transfer_throughput.py", "--params", "2M", "--rounds", "1", "--tcp-bytes", "64M", "--out", str(out))
    # Every checksum passed, or the script exited 1.
    result = json.loads(out.read_text())
    (size,) = result["sizes"]
    assert size["configs"][0]["name"] == "packed 64MiB x2 fp32 shm"
    floor = result["ring_copy_floor"]
    assert all(floor[f"{side}_{wire}_s"] > 0 for side in ("trainer", "receiver", "both") for wire in ("fp32", "bf16"))
    assert {"per_parameter", "disk"} <= set(size)
    names = {c["name"] for c in size["configs"]}
    assert {"packed 64MiB x2 bf16 shm", "packed 64MiB x2 bf16 shm cast-in-source"} <= names
    assert out.with_suffix(".md").read_text().startswith("Trainer -> reference receiver")
    assert out.with_suffix(".png").stat().st_size > 0


def test_callback_overhead_smoke(tmp_path):
    out = tmp_path / "overhead.json"
    run("benchmarks/callback_overhead.py", "--steps", "30", "--repeats", "1", "--out", str(out))
    assert {"median_step_s_without", "median_step_s_with", "median_hook_s"} <= set(json.loads(out.read_text()))


def test_checkpoint_format_cost_smoke(tmp_path):
    out = tmp_path / "checkpoint_format.json"
    run("benchmarks/checkpoint_format_cost.py", "--layers", "1", "--experts", "4", "--hidden", "128", "--rounds", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["receiver_checksums_equal"] and result["sent_tensors"] > result["in_memory_tensors"]


def test_sharded_sync_smoke(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "sharded.json"
    # One wire; also the 2-rank rounds into a receiver for FSDP1 (use_orig_params=True) and ZeRO-2.
    schemes = "fsdp1-orig,zero3,zero2"
    args = ["--params", "2M", "--cycles", "1", "--schemes", schemes, "--wires", "bfloat16", "--out", str(out)]
    run("benchmarks/sharded_sync.py", *args)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["scheme"], r["wire"], r["source_scheme"]) for r in rows] == [
        ("fsdp1-orig", "bfloat16", "fsdp1"), ("zero3", "bfloat16", "zero3"), ("zero2", "bfloat16", "local"),
    ]  # fmt: skip
    assert all(r["checksum"]["passed"] and r["rss_extra_max"] <= r["bound"] for r in rows)


def test_soak_smoke(tmp_path):
    out = tmp_path / "soak.json"
    run("benchmarks/soak.py", "--target", "receiver", "--rounds", "5", "--at", "2", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["failed_rounds"] == 0 and result["final_check"] == "checksums equal"
    assert [row["round"] for row in result["series"]] == [1, 2, 5]


def test_sync_under_load_smoke(tmp_path):
    """Every commit mode and one staged at a niceness, one block each (the
    streamed downtime needs vLLM: tests/test_vllm_e2e.py)."""
    out = tmp_path / "load.json"
    run("benchmarks/sync_under_load.py", "--target", "receiver", "--clients", "2", "--seconds", "6",
        "--sync-every", "0.5", "--blocks", "1", "--max-tokens", "2", "--commits", "inline,staged,prepared,prepared@3",
        "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert result["failed_rounds"] == 0 and set(result["modes"]) == {"inline", "staged", "prepared", "prepared@3"}
    for mode in result["modes"].values():
        assert mode["rounds"] >= 1 and sum(c["requests"] for c in mode["requests"].values()) > 0
    assert result["server_rss_growth_over_model_bytes"] is not None


def test_lora_sync_smoke(tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "lora.json"
    shape = ["--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "2", "--kv-heads", "1", "--vocab", "1000"]
    run("benchmarks/lora_sync.py", "--target", "receiver", *shape, "--rank", "4", "--rounds", "1", "--out", str(out))
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"adapter", "merge", "merge-every-round", "full"}
    # Merging sends the full model's bytes in a connection's first round; later, the frozen tensors stay where they are.
    assert rows["merge"]["first_round_bytes"] == rows["merge-every-round"]["bytes_per_round"] == rows["full"]["bytes_per_round"]
    assert rows["adapter"]["bytes_per_round"] < rows["merge"]["bytes_per_round"] < rows["full"]["bytes_per_round"]
    assert all(r["verify_max_logprob_diff"] <= 0.1 for r in rows.values())
