"""WeightSyncHook in real ``accelerate launch`` runs, syncing into receiver processes.

Single process and 2-process MULTI_CPU (DDP over gloo); 2-process DeepSpeed
ZeRO-2 and ZeRO-3 through Accelerate's own DeepSpeed path, which runs on a
CPU (``--use_deepspeed`` with a config file); FSDP1 with both
``use_orig_params`` settings. Accelerate's FSDP plugin cannot run on a CPU
(version 1 refuses: "no available devices found"; version 2 is silently
dropped, and ``--cpu`` excludes ``--use_fsdp``), so for FSDP1 the app wraps
the model in ``FullyShardedDataParallel(device_id=cpu)`` itself, as the
plugin would, and hands the hook that; FSDP2 (DTensor parameters) is covered
by the driver's and Lightning's torchrun tests. ``tests/test_gpu.py`` runs
Accelerate's FSDP plugin (versions 1 and 2) on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests

from tests.support import REPO_ROOT
from wt_callbacks.demos import models

pytest.importorskip("accelerate")

APP = "tests.support.accelerate_app"
NAMES = {n for n, _ in models.tiny_mlp().named_parameters()}


def served(url: str) -> dict:
    info = requests.get(f"{url}/weight_info", timeout=30).json()
    info["checksums"] = requests.get(f"{url}/weight_checksums", timeout=30).json()["checksums"]
    return info


def launch(tmp_path, *args: str, processes: int = 1, launcher: tuple[str, ...] = ("--multi_gpu",), env=None) -> dict:
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.json"
    if processes == 1:
        cmd = [sys.executable, "-m", APP]
    else:
        # `--cpu --num_processes 2` would silently run ONE process; `--multi_gpu`
        # with Accelerator(cpu=True) in the script gives two MULTI_CPU ranks.
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", *launcher, "--num_processes", str(processes),
            "--num_machines", "1", "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", APP,
        ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run([*cmd, *args, "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["optimizer", "raw-optimizer", "manual"])
def test_single_process_counts_real_optimizer_steps(receiver_proc, tmp_path, mode):
    receiver = receiver_proc()
    result = launch(tmp_path, "--server", receiver.url, "--steps", "9", "--grad-accum", "2", "--every", "3", "--mode", mode)
    info = served(receiver.url)
    # 18 micro-batches, 9 optimizer steps: cold sync + every third real step;
    # step 9 is already served, so close() adds nothing.
    assert info["version_history"] == ["step-0", "step-3", "step-6", "step-9"]
    assert info["checksums"] == result["checksums"]
    assert result["num_processes"] == 1 and result["state"]["global_step"] == 9
    # One row per sync, at its step, with the gauges.
    rows = [(step, row["weight_sync/step"], row["weight_sync/steps_behind"], row["weight_sync/failures"]) for step, row in result["logged"]]
    assert rows == [(0, 0.0, 0.0, 0.0), (3, 3.0, 0.0, 0.0), (6, 6.0, 0.0, 0.0), (9, 9.0, 0.0, 0.0)]


def test_two_multi_cpu_processes(receiver_proc, tmp_path):
    receiver = receiver_proc()
    result = launch(tmp_path, "--server", receiver.url, "--steps", "9", processes=2)
    assert result["num_processes"] == 2 and result["distributed_type"] == "DistributedType.MULTI_CPU"
    info = served(receiver.url)
    assert info["version_history"] == ["step-0", "step-3", "step-6", "step-9"]
    assert info["checksums"] == result["checksums"]


def test_compiled_model_sends_checkpoint_names(receiver_proc, tmp_path):
    receiver = receiver_proc()
    result = launch(tmp_path, "--server", receiver.url, "--steps", "3", "--compile")
    info = served(receiver.url)
    assert set(info["checksums"]) == NAMES  # no `_orig_mod.` reached the server
    assert info["checksums"] == result["checksums"]


@pytest.mark.parametrize("processes", [1, 2])
def test_save_state_load_state_resume(receiver_proc, tmp_path, processes):
    receiver = receiver_proc()
    ckpt = str(tmp_path / "ckpt")
    launch(tmp_path, "--server", receiver.url, "--steps", "6", "--save-dir", ckpt, processes=processes)
    result = launch(tmp_path, "--server", receiver.url, "--steps", "9", "--load-dir", ckpt, processes=processes)
    info = served(receiver.url)
    # Second run: its cold sync waits for load_state and sends the restored
    # step-6 weights (not fresh ones), then the cadence continues.
    assert info["version_history"] == ["step-0", "step-3", "step-6", "step-6", "step-9"]
    assert info["checksums"] == result["checksums"]
    assert result["state"]["global_step"] == 9 and result["state"]["syncs_completed"] == 5


def test_misconfiguration_and_dead_servers_fail_at_construction(tmp_path):
    import time

    import torch
    from accelerate import Accelerator

    from wt_callbacks.demos.multiprocess import free_port
    from wt_callbacks.integrations.accelerate import WeightSyncHook
    from wt_callbacks.transfer import WeightTransferError

    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(models.tiny_mlp(seed=0), torch.optim.SGD(models.tiny_mlp().parameters(), lr=1))
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match="unknown key 'every_n_train_step'; did you mean 'every_n_train_steps'"):
        WeightSyncHook(accelerator, model, optimizer, servers=[dead], every_n_train_step=3)
    with pytest.raises(ValueError, match="no such YAML file"):
        WeightSyncHook(accelerator, model, optimizer, hparams=str(tmp_path / "missing.yaml"))
    (tmp_path / "ws.yaml").write_text("weight_sync:\n  servers: [%s]\n  pause: later\n" % dead)
    with pytest.raises(ValueError, match="pause='later' is not one of"):
        WeightSyncHook(accelerator, model, optimizer, hparams=str(tmp_path / "ws.yaml"))
    with pytest.raises(ValueError, match="optimizer was not prepared by this accelerator"):
        WeightSyncHook(accelerator, model, torch.optim.SGD(model.parameters(), lr=1), servers=[dead])
    start = time.monotonic()
    with pytest.raises(WeightTransferError, match="cannot reach the server"):
        WeightSyncHook(accelerator, model, optimizer, servers=[dead], timeout_s=5)
    assert time.monotonic() - start < 10
    # on_error="warn": the loop goes on without a server.
    hook = WeightSyncHook(accelerator, model, optimizer, servers=[dead], timeout_s=5, on_error="warn")
    optimizer.step()
    hook.close()
    assert hook.global_step == 1


# --------------------------------------------------------------------------- #
# Sharded: FSDP1 and DeepSpeed, two processes, a bf16 wire
# --------------------------------------------------------------------------- #

MiB = 1024**2
BUCKET = 1 * MiB
WIDE_LAYER_BYTES = (512 * 512 + 512) * 4
"""One layer of ``models.wide_mlp`` in fp32 (an FSDP1 unit of its own)."""
WIDE_MODEL_BYTES = 16 * WIDE_LAYER_BYTES


def deepspeed_launcher(tmp_path, stage: int) -> tuple[str, ...]:
    config = tmp_path / f"zero{stage}.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        # Every parameter partitioned, the small ones too.
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }))  # fmt: skip
    return ("--use_deepspeed", "--deepspeed_config_file", str(config))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "mode", "detected", "scheme_bytes"),
    [
        # What the scheme adds to the transport's share. FSDP1: the unit being
        # gathered (one layer, in bf16), twice (gloo copies a CPU all-gather's
        # output), and one more unit per chunk the transport holds (a held
        # view keeps its whole unit's buffer). ZeRO-3: the group, twice, in
        # the parameters' fp32; a group is up to 64 MiB, so here it is the
        # whole model (benchmarks/sharded_sync.py shows the bound at 100M).
        # One launch per way the hook counts steps (torch optimizer hooks; DeepSpeed's
        # engine step). FSDP1 with use_orig_params=True and ZeRO-2 go into a receiver from
        # two ranks in test_benchmarks.py's sharded_sync smoke, and send what the unwrapped
        # model sends in test_sharded_sources.py: a launch each would add ~35 s to CI.
        ("fsdp1-flat", "optimizer", "fsdp1", 4 * WIDE_LAYER_BYTES // 2),
        ("zero3", "optimizer", "zero3", 2 * WIDE_MODEL_BYTES),
    ],
)
def test_two_sharded_processes(receiver_proc, tmp_path, capsys, no_ring_left_behind, run, mode, detected, scheme_bytes):
    """Gradient accumulation 2, a sync every 3 real steps, a bf16 wire, then
    three rounds measuring what a round adds to the sender's memory."""
    if run.startswith("zero"):
        pytest.importorskip("deepspeed")
        from wt_callbacks.demos.deepspeed_cpu import shm_files

        shm_before = shm_files()
        launcher = deepspeed_launcher(tmp_path, int(run[-1]))
        extra: tuple[str, ...] = ()
    else:
        launcher = ("--multi_gpu",)
        extra = ("--fsdp1", run.removeprefix("fsdp1-"))
    receiver = receiver_proc("wt_callbacks.demos.models:wide_mlp")
    result = launch(
        tmp_path, "--server", receiver.url, "--steps", "9", "--grad-accum", "2", "--every", "3", "--mode", mode,
        "--model", "wide_mlp", "--dtype", "bfloat16", "--bucket", str(BUCKET), "--measure-rounds", "3", *extra,
        processes=2, launcher=launcher,
        # Freed blocks go back to the OS at once: the peaks follow what is live.
        env={"MALLOC_MMAP_THRESHOLD_": "65536", "DS_ACCELERATOR": "cpu"},
    )  # fmt: skip
    assert result["num_processes"] == 2 and result["scheme"] == detected
    info = served(receiver.url)
    assert info["version_history"] == ["step-0", "step-3", "step-6", "step-9", "measure-1", "measure-2", "measure-3"]
    # The fp32 receiver holds the trainer's full weights rounded through bf16.
    assert info["checksums"] == result["checksums"]
    # The transport's buffers and the largest tensor in flight, plus the scheme's share.
    bound = 2 * BUCKET + 512 * 512 * 2 + scheme_bytes
    peaks = result["measured_rss"]
    with capsys.disabled():
        print(f"\n{run}: sender's peak extra RSS per round {[round(p / MiB, 2) for p in peaks]} MiB, "
              f"bound {bound / MiB:.2f} MiB, model {WIDE_MODEL_BYTES / MiB:.2f} MiB in fp32")
    assert max(peaks) <= bound
    if run.startswith("zero"):
        assert shm_files() == shm_before  # DeepSpeed's shm op was never built nor mapped


@pytest.mark.slow
def test_send_async_from_two_zero3_processes(receiver_proc, tmp_path, no_ring_left_behind):
    """``send: async`` under DeepSpeed ZeRO-3 through the hook: the gathers run
    on both ranks into rank 0's snapshot, rank 0's thread sends it, and the
    end of training collects the last round. (FSDP2 ranks: tests/test_async_send.py.)"""
    pytest.importorskip("deepspeed")
    receiver = receiver_proc("wt_callbacks.demos.models:wide_mlp")
    result = launch(
        tmp_path, "--server", receiver.url, "--steps", "9", "--grad-accum", "2", "--every", "3", "--mode", "optimizer",
        "--model", "wide_mlp", "--dtype", "bfloat16", "--bucket", str(BUCKET), "--send", "async",
        processes=2, launcher=deepspeed_launcher(tmp_path, 3), env={"DS_ACCELERATOR": "cpu"},
    )  # fmt: skip
    assert result["scheme"] == "zero3"
    info = served(receiver.url)
    assert info["version_history"] == ["step-0", "step-3", "step-6", "step-9"]
    assert info["checksums"] == result["checksums"]
    assert result["state"]["syncs_completed"] == 4 and result["state"]["last_synced_step"] == 9

