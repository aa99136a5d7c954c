"""The FSDP2 gather benchmark runs at smoke size so it never rots (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import REPO_ROOT


def test_fsdp2_gather_smoke(tmp_path):
    out = tmp_path / "fsdp2_gather.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/fsdp2_gather.py", "--params", "2M", "--rounds", "1", "--timeout", "60",
         "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    rows = {row["name"]: row for row in result["rows"]}
    assert set(rows) == {
        "fp32 bucketed", "fp32 bucketed, rank 1 builds tensors", "fp32 per-parameter", "bf16 bucketed",
        "bf16 bucketed, rank 1 builds tensors", "bf16 per-parameter", "bf16 gather-then-cast",
    }
    assert all(row["checksum"]["passed"] for row in rows.values())
    # The baselines kept their own iteration: the engine did not swap in a ModuleSource.
    assert rows["bf16 gather-then-cast"]["source"] == "GatherThenCastSource"
    assert rows["bf16 per-parameter"]["source"] == "PerParameterGatherSource"
    assert rows["bf16 bucketed, rank 1 builds tensors"]["source"] == "NonSendersBuildTensorsSource"
    assert rows["bf16 bucketed"]["bytes"] == rows["bf16 gather-then-cast"]["bytes"] == rows["bf16 per-parameter"]["bytes"]
    assert rows["fp32 bucketed"]["bytes"] == 2 * rows["bf16 bucketed"]["bytes"]
    assert set(result["raw_all_gather"]) == {"float32 bucketed", "float32 per-tensor", "bfloat16 bucketed", "bfloat16 per-tensor"}
    assert set(result["ratios"]["vs_raw_all_gather"]) == set(rows)
