"""WeightSyncTrainerCallback in real ``transformers.Trainer.train`` runs on CPU.

Every run takes 2 micro-batches per optimizer step (gradient_accumulation_steps=2),
10 optimizer steps, a sync every 3 and a checkpoint every 6: the servers get
the cold sync, steps 3, 6, 9 and the final step 10, never a micro-batch.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import requests

pytest.importorskip("transformers")

from tests.support import REPO_ROOT  # noqa: E402
from tests.support.transformers_app import run  # noqa: E402
from wt_callbacks.checksums import module_checksums  # noqa: E402
from wt_callbacks.demos import toy_task  # noqa: E402
from wt_callbacks.receiver import Receiver  # noqa: E402

SERVED = "wt_callbacks.demos.toy_task:served_model"
EXPECTED = ["step-0", "step-3", "step-6", "step-9", "step-10"]


@pytest.fixture
def receivers():
    """In-process receivers serving the toy LM from another seed than the trainer's."""
    started: list[Receiver] = []

    def start() -> Receiver:
        receiver = Receiver(toy_task.served_model())
        receiver.start()
        started.append(receiver)
        return receiver

    yield start
    for receiver in started:
        receiver.stop()


def test_single_process_syncs_on_optimizer_steps_logs_once_and_resumes(receivers, tmp_path):
    first, second, restarted = receivers(), receivers(), receivers()
    section = {"servers": [first.url], "every_n_train_steps": 3, "timeout_s": 60}
    # The section as a field of the user's TrainingArguments subclass.
    result = run(str(tmp_path), weight_sync=section, callbacks=[{}])
    print("1 process:", first.core.version_history, "checksums equal:", module_checksums(first.model) == result["checksums"])
    assert first.core.version_history == EXPECTED
    assert module_checksums(first.model) == result["checksums"]
    # One log row per sync, at its step; the gauge on every logging step.
    assert result["synced"] == [(0, 0.0), (3, 3.0), (6, 6.0), (9, 9.0), (10, 10.0)]
    assert result["steps_behind"] == [(s, float(s % 3 if s < 10 else 0)) for s in range(1, 11)]
    saved = json.loads((tmp_path / "checkpoint-6/trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["WeightSyncTrainerCallback"]["attributes"]["_restored"]["last_synced_step"] == 6

    # Resume from checkpoint-6, the section from a YAML file now, its server
    # restarted on a new port (the state is keyed on what is synced, not
    # where to); a second callback (another server, every 2 steps, its own
    # hparams_key) that checkpoint knows nothing of.
    (tmp_path / "ws.yaml").write_text(json.dumps({"weight_sync": {**section, "servers": [restarted.url]}}))
    rollout = {"servers": [second.url], "every_n_train_steps": 2, "hparams_key": "rollout_sync"}
    resumed = run(
        str(tmp_path),
        callbacks=[{"hparams": str(tmp_path / "ws.yaml")}, rollout],
        resume_from=str(tmp_path / "checkpoint-6"),
    )
    print("1 process, resumed at step 6:", restarted.core.version_history, second.core.version_history)
    # A cold sync of the restored weights, then the cadence continues.
    assert first.core.version_history == EXPECTED
    assert restarted.core.version_history == ["step-6", "step-9", "step-10"]
    assert second.core.version_history == ["step-6", "step-8", "step-10"]
    assert module_checksums(restarted.model) == module_checksums(second.model) == resumed["checksums"]
    saved = json.loads((tmp_path / "checkpoint-10/trainer_state.json").read_text())["stateful_callbacks"]
    counters = {e["attributes"]["_restored"]["key"]: e["attributes"]["_restored"] for e in saved["WeightSyncTrainerCallback"]}
    # Counters continued from the checkpoint (3 rounds there, 3 since); each callback kept its own.
    assert sorted((c["syncs_completed"], c["last_synced_step"]) for c in counters.values()) == [(3, 10), (6, 10)]


def test_send_async_rows_come_when_each_round_is_collected(receivers, tmp_path):
    """Under ``send: async`` a round's row comes when it is collected, at the
    next due step (``weight_sync/step`` says which step it sent); the last
    step's checkpoint waits for the round in flight and records it; the end
    of training collects the round of step 9, then sends step 10: both rows."""
    receiver = receivers()
    section = {"servers": [receiver.url], "every_n_train_steps": 3, "timeout_s": 60, "send": "async"}
    result = run(str(tmp_path), weight_sync=section, callbacks=[{}])
    assert receiver.core.version_history == EXPECTED
    assert module_checksums(receiver.model) == result["checksums"]
    assert result["synced"] == [(0, 0.0), (6, 3.0), (9, 6.0), (10, 9.0), (10, 10.0)]
    saved = json.loads((tmp_path / "checkpoint-6/trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["WeightSyncTrainerCallback"]["attributes"]["_restored"]["last_synced_step"] == 6


def test_epoch_cadence_follows_the_trainers_epochs_after_a_resume_without_its_state(receivers, tmp_path):
    """16 rows: an epoch every 2 optimizer steps. A run without the callback
    writes checkpoint-6 (3 epochs done); resumed with every_n_epochs=2, the
    callback syncs at the end of epoch 4 (step 8), not 2 epochs after it
    joined (it counted epochs itself and synced at step 10 only)."""
    receiver = receivers()
    run(str(tmp_path), rows=16)
    section = {"servers": [receiver.url], "every_n_epochs": 2, "timeout_s": 60}
    resumed = run(str(tmp_path), weight_sync=section, callbacks=[{}], rows=16, resume_from=str(tmp_path / "checkpoint-6"))
    assert receiver.core.version_history == ["step-6", "step-8", "step-10"]
    assert module_checksums(receiver.model) == resumed["checksums"]


def test_two_processes_torchrun_gloo(receiver_proc, tmp_path):
    receiver = receiver_proc(SERVED)
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "tests.support.transformers_app", "--server", receiver.url,
        "--out-dir", str(tmp_path / "run"), "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    history = requests.get(f"{receiver.url}/weight_info", timeout=30).json()["version_history"]
    print("2 processes:", history, "checksums equal:", receiver.checksums() == result["checksums"])
    assert result["world_size"] == 2
    assert history == EXPECTED
    assert receiver.checksums() == result["checksums"]
    assert result["synced"] == [[0, 0.0], [3, 3.0], [6, 6.0], [9, 9.0], [10, 10.0]]


def test_misconfiguration_fails_when_the_trainer_is_built(tmp_path):
    from transformers import Trainer

    from tests.support.transformers_app import ReversalRows, SyncTrainingArguments, training_arguments
    from wt_callbacks.integrations.transformers import WeightSyncTrainerCallback

    args = SyncTrainingArguments(weight_sync={"servers": ["http://127.0.0.1:9"], "every_n_train_step": 2}, **training_arguments(str(tmp_path), 2))
    model = toy_task.build_model(toy_task.build_tokenizer(), seed=0)
    with pytest.raises(ValueError, match="did you mean 'every_n_train_steps'"):
        Trainer(model=model, args=args, train_dataset=ReversalRows(8), callbacks=[WeightSyncTrainerCallback()])


def test_two_callbacks_with_one_key_are_refused(receivers, tmp_path):
    """They would restore each other's counters at a resume."""
    first, second = receivers(), receivers()
    with pytest.raises(ValueError, match=r"hparams_key='weight_sync' and send module=None.*own hparams_key"):
        run(str(tmp_path), weight_sync={"servers": [first.url], "timeout_s": 60}, callbacks=[{}, {"servers": [second.url]}])


def test_trl_sft_trainer(receivers, tmp_path):
    """TRL's SFTTrainer (a Trainer subclass with its own ``log``): the same
    callback, the same syncs, and TRL's own metrics stay on its loss rows."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from tests.support.transformers_app import training_arguments
    from wt_callbacks.integrations.transformers import WeightSyncTrainerCallback

    receiver = receivers()
    tokenizer = toy_task.build_tokenizer()
    rng = random.Random(0)
    texts = [" ".join(toy_task.sample(rng)) for _ in range(400)]
    args = trl.SFTConfig(**training_arguments(str(tmp_path), 10), max_length=32, dataset_text_field="text", packing=False)
    trainer = trl.SFTTrainer(
        model=toy_task.build_model(tokenizer, seed=0), args=args,
        train_dataset=Dataset.from_dict({"text": texts}), processing_class=tokenizer,
    )  # fmt: skip
    trainer.add_callback(WeightSyncTrainerCallback(trainer, servers=[receiver.url], every_n_train_steps=3, timeout_s=60))
    trainer.train()
    print(f"TRL {trl.__version__} SFTTrainer:", receiver.core.version_history,
          "checksums equal:", module_checksums(receiver.model) == module_checksums(trainer.model))  # fmt: skip
    assert receiver.core.version_history == EXPECTED
    assert module_checksums(receiver.model) == module_checksums(trainer.model)
    history = trainer.state.log_history
    synced = [(r["step"], r["weight_sync/step"]) for r in history if "weight_sync/syncs_completed" in r]
    assert synced == [(0, 0.0), (3, 3.0), (6, 6.0), (9, 9.0), (10, 10.0)]
    # SFTTrainer.log merges its pending train metrics into the next row it
    # logs: they must land on the loss rows, never on a weight_sync row.
    loss_rows = [r for r in history if "loss" in r]
    assert len(loss_rows) == 10 and all("mean_token_accuracy" in r for r in loss_rows)
    assert not any("mean_token_accuracy" in r for r in history if any(k.startswith("weight_sync/") for k in r))
