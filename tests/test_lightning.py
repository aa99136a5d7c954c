"""WeightSyncCallback in real Trainer.fit runs on CPU, syncing into receiver processes.

Strategies here: single device, DDP and ModelParallelStrategy (FSDP2). Lightning's
FSDPStrategy ("requires a GPU accelerator") and DeepSpeedStrategy ("only supported on CUDA
GPUs") refuse a CPU. The callback hands WeightSync ``trainer.strategy.model``, which under
them is the FSDP1 root unit around the LightningModule or the DeepSpeed engine:
tests/test_sharded_sources.py sends from models wrapped exactly so, tests/test_accelerate.py
trains them through the same driver, and tests/test_gpu.py runs both strategies on a GPU.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import requests
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402

from tests.support import REPO_ROOT  # noqa: E402
from tests.support.lightning_app import StepHook, run  # noqa: E402
from wt_callbacks.demos import models  # noqa: E402
from wt_callbacks.demos.multiprocess import free_port  # noqa: E402
from wt_callbacks.integrations.lightning import WeightSyncCallback  # noqa: E402

TIMEOUT_S = 30


def served(url: str) -> dict:
    info = requests.get(f"{url}/weight_info", timeout=TIMEOUT_S).json()
    info["checksums"] = requests.get(f"{url}/weight_checksums", timeout=TIMEOUT_S).json()["checksums"]
    return info


def section(url: str, **keys) -> dict:
    return {"servers": [url], "module": "model", "timeout_s": TIMEOUT_S, **keys}


def test_accumulation_counts_optimizer_steps(receiver_proc):
    receiver = receiver_proc()
    result = run(section(receiver.url, every_n_train_steps=3), max_steps=9, accumulate=2)
    info = served(receiver.url)
    # 18 micro-batches, 9 optimizer steps: the cold sync, every third step, and
    # no final sync because step 9 is already on the server.
    assert info["version_history"] == ["step-0", "step-3", "step-6", "step-9"]
    assert info["checksums"] == result["checksums"]
    assert result["state"]["syncs_completed"] == 4 and result["state"]["last_synced_step"] == 9


def test_arguments_override_hparams_and_final_sync(receiver_proc):
    receiver = receiver_proc()
    result = run(
        section(receiver.url, every_n_train_steps=100, sync_on_fit_start=True),
        max_steps=5,
        callback_kwargs={"every_n_train_steps": 2, "sync_on_fit_start": False},
    )
    info = served(receiver.url)
    assert info["version_history"] == ["step-2", "step-4", "step-5"]
    assert info["checksums"] == result["checksums"]


def test_every_n_epochs(receiver_proc):
    receiver = receiver_proc()
    result = run(section(receiver.url, every_n_epochs=2), max_epochs=4, batches=3)
    assert served(receiver.url)["version_history"] == ["step-0", "step-6", "step-12"]
    assert served(receiver.url)["checksums"] == result["checksums"]


def test_train_time_interval(receiver_proc):
    receiver = receiver_proc()
    run(section(receiver.url, train_time_interval=0.6), max_steps=12, step_sleep_s=0.2)
    versions = served(receiver.url)["version_history"]
    steps = [int(v.split("-")[1]) for v in versions]
    assert steps[0] == 0 and steps[-1] == 12
    timed = steps[1:-1] if steps[-1] != steps[-2] else steps[1:]
    # ~0.2 s per step and a 0.6 s interval: time-triggered syncs happened, at
    # least two steps apart (wall-clock scheduling noise allowed for).
    assert len(timed) >= 1
    assert all(b - a >= 2 for a, b in zip([0, *timed], timed))


@pytest.mark.parametrize(("strategy", "send"), [("auto", "blocking"), ("model_parallel", "blocking"), ("auto", "async")])
def test_resume_cold_syncs_then_cadence_continues(receiver_proc, tmp_path, strategy, send, request):
    """The restarted job's server is on a new port (as after most restarts):
    the resume state still applies, since it is keyed on what is synced.
    ModelParallelStrategy (as FSDP and DeepSpeed) restores the callbacks after
    on_fit_start, once the driver exists. Under ``send: async`` each checkpoint
    is taken while the round of its step is in flight (ModelCheckpoint runs
    after the callback launched it): it records that step once acknowledged."""
    if strategy == "model_parallel":
        # One device, in this process: the default group it starts would stay
        # up for the next test file this pytest worker runs.
        request.addfinalizer(lambda: torch.distributed.is_initialized() and torch.distributed.destroy_process_group())
    receiver, restarted = receiver_proc(), receiver_proc()
    keys = {"every_n_train_steps": 3, "send": send}
    first = run(section(receiver.url, **keys), strategy=strategy, max_steps=6, ckpt_dir=str(tmp_path))
    assert first["state"]["last_synced_step"] == 6
    ckpt = next(p for p in tmp_path.iterdir() if "step=6" in p.name)
    second = run(section(restarted.url, **keys), strategy=strategy, max_steps=9, resume_from=str(ckpt))
    assert served(receiver.url)["version_history"] == ["step-0", "step-3", "step-6"]
    info = served(restarted.url)
    # A cold sync after the resume (the server may hold anything), then on cadence.
    assert info["version_history"] == ["step-6", "step-9"]
    assert info["checksums"] == second["checksums"]
    # Counters continued from the checkpoint.
    assert second["state"]["syncs_completed"] == 5


def test_epoch_cadence_follows_the_trainer_when_a_callback_is_reused(receiver_proc):
    """A callback object reused for a second fit (a sweep, a second phase)
    counts the new trainer's epochs, as ModelCheckpoint does, not its own."""
    main, epochs = receiver_proc(), receiver_proc()
    reused = WeightSyncCallback(
        servers=[epochs.url], module="model", every_n_epochs=2, sync_on_fit_start=False, sync_on_train_end=False,
        timeout_s=TIMEOUT_S, hparams_key="epoch_sync",
    )  # fmt: skip
    for _ in range(2):
        run(section(main.url, every_n_train_steps=100), max_epochs=3, batches=3, extra_sync_callbacks=[reused])
    # Epoch 2 of each fit (step 6), never epoch 1 or 3 of the second.
    assert served(epochs.url)["version_history"] == ["step-6", "step-6"]


def test_training_step_taking_the_dataloader_iter(receiver_proc):
    receiver = receiver_proc()
    result = run(section(receiver.url, every_n_train_steps=2), max_steps=4, task="dataloader-iter")
    info = served(receiver.url)
    assert info["version_history"] == ["step-0", "step-2", "step-4"]
    assert info["checksums"] == result["checksums"]


def test_warn_survives_a_dead_server_and_resyncs_when_it_is_back(receiver_proc, caplog):
    port = free_port()
    procs = {"current": receiver_proc(port=port)}

    def chaos(step: int) -> None:
        if step == 3:
            procs["current"].kill()
        if step == 7:
            procs["current"] = receiver_proc(port=port)

    caplog.set_level(logging.WARNING, logger="wt_callbacks")
    logger = _CaptureLogger()
    result = run(
        section(procs["current"].url, every_n_train_steps=2, on_error="warn", timeout_s=10),
        max_steps=12,
        extra_callbacks=[StepHook(chaos)],
        logger=logger,
        log_every_n_steps=1,
    )
    assert result["global_step"] == 12
    failures = [r for r in caplog.records if "training continues" in r.getMessage()]
    assert failures, "the failed rounds must be logged"
    counted = [m["weight_sync/failures"] for _, m in logger.metrics if "weight_sync/failures" in m]
    assert counted[0] == 0 and counted[-1] == len(failures) == result["state"]["failures"]
    info = served(procs["current"].url)
    # The restarted server got the rounds after it came back, and the final weights.
    assert info["version_history"][-1] == "step-12"
    assert set(info["version_history"]) <= {"step-8", "step-10", "step-12"}
    assert info["checksums"] == result["checksums"]


def test_raise_stops_fit_with_the_server_error(receiver_proc):
    receiver = receiver_proc()

    def kill(step: int) -> None:
        if step == 2:
            receiver.kill()

    from wt_callbacks.transfer import WeightTransferError

    with pytest.raises(WeightTransferError, match="weight sync round for step 4"):
        run(section(receiver.url, every_n_train_steps=2, timeout_s=10), max_steps=8, extra_callbacks=[StepHook(kill)])


def test_misconfiguration_fails_in_setup_before_training(receiver_proc):
    with pytest.raises(ValueError, match="every_n_train_steps and every_n_epochs are mutually exclusive"):
        run({"servers": ["http://127.0.0.1:9"], "every_n_train_steps": 2, "every_n_epochs": 1}, max_steps=2)
    with pytest.raises(ValueError, match="no servers to sync to"):
        run({"every_n_train_steps": 2}, max_steps=2)
    with pytest.raises(ValueError, match="did you mean 'every_n_train_steps'"):
        run({"servers": ["http://127.0.0.1:9"], "every_n_train_step": 2}, max_steps=2)
    # Two callbacks reading one section for the same submodule would share one
    # resume state. Lightning refuses equal keys when the Trainer is built; these
    # are equal only once the section gave the first one its module.
    twin = WeightSyncCallback(servers=["http://127.0.0.1:10"], module="model")
    with pytest.raises(ValueError, match=r"hparams_key='weight_sync' and send module='model'.*own hparams_key"):
        run({"servers": ["http://127.0.0.1:9"], "module": "model"}, max_steps=2, extra_sync_callbacks=[twin])


def _torchrun(tmp_path, weight_sync: dict, strategy: str) -> dict:
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "tests.support.lightning_app",
        "--weight-sync", json.dumps(weight_sync), "--strategy", strategy, "--devices", "2",
        "--max-steps", "6", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(("strategy", "send"), [("ddp", "blocking"), ("model_parallel", "blocking"), ("model_parallel", "async")])
def test_two_process_strategies(receiver_proc, tmp_path, strategy, send):
    """Under ``send: async`` (FSDP2) both ranks gather into rank 0's snapshot
    at each due step, and the end of training collects the last round."""
    receiver = receiver_proc()
    result = _torchrun(tmp_path, section(receiver.url, every_n_train_steps=3, dtype="bfloat16", send=send), strategy)
    info = served(receiver.url)
    assert info["version_history"] == ["step-0", "step-3", "step-6"]
    # bf16 on the wire: the fp32 receiver holds the trainer's weights rounded through bf16.
    assert info["checksums"] == result["checksums"]
    assert result["state"]["syncs_completed"] == 3
    assert result["sharded"] == (strategy == "model_parallel")


def test_lightning_cli_yaml(receiver_proc, tmp_path):
    """The example YAML drives the callback through LightningCLI into a receiver
    started with the CLI's --model on a saved transformers checkpoint."""
    model_dir = tmp_path / "toy"
    subprocess.run([sys.executable, "-m", "wt_callbacks.demos.toy_task", str(model_dir)], check=True, timeout=120)
    receiver = receiver_proc("", extra_args=("--model", str(model_dir)))
    config = (REPO_ROOT / "examples/lightning_cli.yaml").read_text()
    config = config.replace("# servers: [http://127.0.0.1:8000]", f"servers: [{receiver.url}]").replace("max_steps: 100", "max_steps: 50")
    (tmp_path / "cli.yaml").write_text(config)
    proc = subprocess.run(
        [sys.executable, "examples/lightning_cli.py", "fit", "--config", str(tmp_path / "cli.yaml")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    # The callback's every_n_train_steps (25) overrode the section's (50).
    assert served(receiver.url)["version_history"] == ["step-0", "step-25", "step-50"]
    name = requests.get(f"{receiver.url}/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
    answer = requests.post(
        f"{receiver.url}/v1/completions",
        json={"model": name, "prompt": "a b c d |", "max_tokens": 4, "temperature": 0, "logprobs": 1},
        timeout=TIMEOUT_S,
    ).json()["choices"][0]
    assert len(answer["logprobs"]["token_logprobs"]) == 4


class _CaptureLogger:
    """A Lightning logger that keeps what it is given."""

    def __new__(cls):
        from lightning.pytorch.loggers.logger import Logger

        class Capture(Logger):
            name = "capture"
            version = 0

            def __init__(self):
                super().__init__()
                self.metrics: list[tuple[int, dict]] = []

            def log_metrics(self, metrics, step=None):
                self.metrics.append((step, dict(metrics)))

            def log_hyperparams(self, params, *args, **kwargs):
                pass

        return Capture()


def test_metrics_sync_now_and_two_callbacks(receiver_proc):
    main, second = receiver_proc(), receiver_proc()
    logger = _CaptureLogger()
    other = WeightSyncCallback(
        servers=[second.url], module="model", every_n_train_steps=2, timeout_s=TIMEOUT_S, hparams_key="rollout_sync"
    )

    def rollout(step: int) -> None:
        if step == 3:
            other.sync_now(trainer_of[0], version="after-rollout-3")

    trainer_of = []

    class Grab(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer_of.append(trainer)

    result = run(
        section(main.url, every_n_train_steps=4),
        max_steps=4,
        extra_sync_callbacks=[other],
        extra_callbacks=[Grab(), StepHook(rollout)],
        logger=logger,
    )
    assert served(main.url)["version_history"] == ["step-0", "step-4"]
    assert served(second.url)["version_history"] == ["step-0", "step-2", "after-rollout-3", "step-4"]
    assert served(second.url)["checksums"] == result["checksums"]
    logged = {k for _, m in logger.metrics for k in m}
    for key in ("seconds", "gather_seconds", "transfer_seconds", "bytes", "gbps", "syncs_completed"):
        assert f"weight_sync/{key}" in logged
    bytes_logged = [m["weight_sync/bytes"] for _, m in logger.metrics if "weight_sync/bytes" in m]
    assert all(b == sum(p.numel() * 4 for p in models.tiny_mlp().parameters()) for b in bytes_logged)


def test_each_sync_is_one_csv_row_and_the_gauges_follow_log_every_n_steps(receiver_proc, tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    receiver = receiver_proc()
    logger = CSVLogger(tmp_path, name="run")
    run(section(receiver.url, every_n_train_steps=5), max_steps=12, accumulate=2, logger=logger, log_every_n_steps=1)
    assert served(receiver.url)["version_history"] == ["step-0", "step-5", "step-10", "step-12"]
    rows = list(csv.DictReader(open(f"{logger.log_dir}/metrics.csv")))
    syncs = [r for r in rows if r["weight_sync/syncs_completed"]]
    # One row per sync, on Lightning's own axis (the row of the batch whose
    # optimizer step it follows; the final one after the last batch); not
    # repeated at the following steps.
    assert [(int(r["step"]), float(r["weight_sync/step"]), float(r["weight_sync/syncs_completed"])) for r in syncs] == [
        (0, 0.0, 1.0), (4, 5.0, 2.0), (9, 10.0, 3.0), (12, 12.0, 4.0),
    ]  # fmt: skip
    gauges = [(int(r["step"]), float(r["weight_sync/steps_behind"])) for r in rows if r["weight_sync/steps_behind"]]
    # Every logging step (Lightning's row step is the step before the optimizer step it logs).
    assert gauges == [(s, float((s + 1) % 5 if s < 10 else s + 1 - 10)) for s in range(12)]
    assert {r["weight_sync/failures"] for r in rows if r["weight_sync/steps_behind"]} == {"0.0"}
