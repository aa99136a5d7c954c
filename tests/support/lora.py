"""PEFT (LoRA) training runs that sync into a server, shared by the vLLM and the reference-receiver tests.

The servers serve the tiny tied-embedding Llama built from seed 0, the base
every run here starts from. ``sharded_rank`` is one of two gloo ranks
holding the PEFT model under FSDP2 or DeepSpeed ZeRO-3; ``trl_run`` is TRL's
``SFTTrainer`` with a ``peft_config``.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import warnings
from pathlib import Path
from typing import Any

import requests
import torch
import torch.distributed as dist

from wt_callbacks.checksums import tensor_sha256
from wt_callbacks.config import SyncConfig
from wt_callbacks.demos import tiny_lms, toy_task
from wt_callbacks.demos.multiprocess import leave_group_together
from wt_callbacks.lora.adapter import AdapterSource
from wt_callbacks.sync import Collectives, WeightSync
from wt_callbacks.transfer import ModuleSource

FAMILY = "llama_tied"
TOLERANCE = 1e-4
ROUND_TIMEOUT_S = 60
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER = {"r": 8, "lora_alpha": 16, "target_modules": [*ALL_LINEAR, "embed_tokens"]}
"""Every linear layer and the embedding, tied to the head: served exactly only as an adapter."""
MERGED = {"r": 8, "lora_alpha": 16, "target_modules": ALL_LINEAR}


def base_model() -> torch.nn.Module:
    return tiny_lms.TINY_LMS[FAMILY](seed=0).eval()


def peft_model(config: dict, state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """``get_peft_model(base_model(), LoraConfig(**config))``, with ``state``
    (saved from ``named_parameters()``: the tied head once, as its embedding)."""
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(base_model(), peft.LoraConfig(**config))
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"base_model.model.lm_head.weight"}, (missing, unexpected)
    return model.eval()


def trained(model: torch.nn.Module, config, seed: int = 3) -> torch.nn.Module:
    """``get_peft_model`` with its adapters moved off their initial values (PEFT starts B, and so every delta, at 0)."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in pm.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return pm


def section(url: str | list[str], **keys: Any) -> dict[str, Any]:
    """A ``weight_sync`` section verifying every round within ``TOLERANCE``."""
    return {"servers": [url] if isinstance(url, str) else url, "timeout_s": ROUND_TIMEOUT_S, "verify_every_n_syncs": 1, "verify_tolerance": TOLERANCE, **keys}


def trl_run(out_dir: Path, weight_sync: dict[str, Any]) -> torch.nn.Module:
    """TRL's SFTTrainer with a ``peft_config`` (TRL wraps the model), 4 steps,
    syncing every 2; returns the trained PEFT model."""
    import peft
    import trl
    from datasets import Dataset

    from tests.support.transformers_app import training_arguments
    from wt_callbacks.integrations.transformers import WeightSyncTrainerCallback

    tokenizer = toy_task.build_tokenizer()
    rng = random.Random(0)
    texts = [" ".join(toy_task.sample(rng)) for _ in range(64)]
    # SFTConfig trains in bf16 by default (the LoRA factors cast to it): fp32 here, as the server serves.
    args = trl.SFTConfig(
        **training_arguments(str(out_dir), 4), max_length=32, dataset_text_field="text", packing=False, bf16=False
    )
    trainer = trl.SFTTrainer(
        model=base_model().train(), args=args, train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=tokenizer, peft_config=peft.LoraConfig(**MERGED),
    )  # fmt: skip
    trainer.add_callback(WeightSyncTrainerCallback(trainer, **{**weight_sync, "every_n_train_steps": 2}))
    trainer.train()
    synced = [r["weight_sync/step"] for r in trainer.state.log_history if "weight_sync/syncs_completed" in r]
    assert synced == [0, 2, 4], synced  # each round verified
    return trainer.model.eval()


def checksums_sent(source: Any, rank: int) -> dict[str, str]:
    """sha256 of what ``source`` sends (every rank runs its gathers; rank 0 hashes)."""
    if rank != 0:
        for _ in source.gather_only():
            pass
        return {}
    return {name: tensor_sha256(tensor) for name, tensor in source}


def sharded_rank(rank: int, port: int, urls: list[str], scheme: str, out_dir: str, api_key: str | None) -> None:
    """One of two gloo ranks under ``scheme`` (``"fsdp2"`` or ``"zero3"``):
    adapter rounds, then merge rounds, then the base put back (the adapters
    disabled), each round verified on every server of ``urls`` (one
    broadcast reaches them all), a real optimizer step between rounds.
    Rank 0 writes each mode's largest logprob difference and, for the
    servers with ``/weight_checksums`` (the reference receiver), whether
    they hold bitwise what was sent."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    if scheme == "zero3":
        import deepspeed

        from wt_callbacks.demos.deepspeed_cpu import skip_shm_comm_op

        skip_shm_comm_op()
        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
    out: dict[str, Any] = {}
    try:
        model = peft_model(MERGED).train()
        batch = toy_task.training_batch(toy_task.build_tokenizer(), random.Random(rank), 8)
        if scheme == "zero3":
            config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}  # fmt: skip
            trainable = [p for p in model.parameters() if p.requires_grad]
            engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable)
            held, peft_root = engine, engine.module

            def step() -> None:
                engine.backward(engine(**batch).loss)
                engine.step()
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (2,))
            for layer in model.base_model.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            held, peft_root = model, model
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

            def step() -> None:
                model(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()

        collectives = Collectives.from_torch_distributed()
        for mode, name in (("adapter", f"{scheme}-policy"), ("merge", None)):
            ws = WeightSync(SyncConfig(**section(urls, lora=mode, lora_name=name, api_key=api_key)))
            ws.setup(held, rank, 2, collectives=collectives)
            try:
                diffs, exact = [], []
                for round_ in range(2):
                    diffs.append(ws.sync(round_).verify_max_logprob_diff)
                    exact.append(_holds_what_was_sent(urls, api_key, held, mode, name, rank))
                    step()
                out[mode] = {"diff": max(diffs), "checksums_equal": exact[0] if all(e == exact[0] for e in exact) else False}
                if mode == "merge":
                    with peft_root.disable_adapter():  # the base checkpoint, for the tests after this one
                        assert ws.sync(9) is not None
            finally:
                ws.close()
    finally:
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps(out))
        leave_group_together()


def _holds_what_was_sent(urls: list[str], api_key: str | None, held: Any, mode: str, name: str | None, rank: int) -> bool | None:
    """Whether the servers' checksums are those of what the source sends
    now; ``None`` when no server has ``/weight_checksums`` (vLLM has not)."""
    source = AdapterSource(held) if mode == "adapter" else ModuleSource(held)
    sent = checksums_sent(source, rank)
    if rank != 0:
        return None
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    answers = [requests.get(f"{url}/weight_checksums", headers=auth, timeout=30) for url in urls]
    held_now = [a.json() for a in answers if a.status_code != 404]
    if not held_now:
        return None
    return all((h["adapters"][name]["checksums"] if mode == "adapter" else h["checksums"]) == sent for h in held_now)
