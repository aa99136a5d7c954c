"""A trainer on one host and its servers on another: two network namespaces joined by a veth pair.

This process is the trainer, on this host; a real vLLM server and the
reference receiver run on the other host (``tests/support/netns.py``), where
this host's 127.0.0.1 is not theirs. Given only the servers' URLs, the
trainer advertises the address it reaches them from and broadcasts over gloo
(the shm ring is for servers on its own host). A trainer whose rendezvous
the servers cannot reach fails with the Python error and exits with its
status, 1, never by an abort at exit.

Skipped, saying why, where the machine cannot make network namespaces (not
root, no ``ip``); without the vLLM venv as the other vLLM tests are.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch

from tests.support import REPO_ROOT
from tests.support.netns import TwoHosts, two_hosts
from tests.support.vllm import running_server
from wt_callbacks.checksums import module_checksums
from wt_callbacks.config import SyncConfig
from wt_callbacks.demos import toy_task
from wt_callbacks.demos.receiver_process import ReceiverProcess, start_receiver
from wt_callbacks.demos.vllm_server import VLLMServer, max_logprob_diff
from wt_callbacks.sync import WeightSync
from wt_callbacks.transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FP32_ATOL = 1e-4
"""Max |logprob difference| vLLM vs transformers in float32 (measured: ~1e-6)."""

FAILED_CONNECT = textwrap.dedent(
    """
    import sys
    from wt_callbacks.config import SyncConfig
    from wt_callbacks.demos import toy_task
    from wt_callbacks.sync import WeightSync

    *servers, master_address = sys.argv[1:]
    sync = WeightSync(SyncConfig(servers=servers, init_info={"master_address": master_address}, timeout_s=30))
    sync.setup(toy_task.build_model(toy_task.build_tokenizer()))
    """
)
"""A trainer told to advertise an address the servers cannot reach; its error is left uncaught."""


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    with two_hosts() as made:
        yield made


@pytest.fixture(scope="module")
def remote_vllm(hosts: TwoHosts, vllm_python: Path, vllm_model_dir: Path, tmp_path_factory) -> Iterator[VLLMServer]:
    log = tmp_path_factory.mktemp("remote-vllm") / "server.log"
    with running_server(vllm_python, vllm_model_dir, log, host=hosts.there, wrapper=hosts.run_there) as server:
        yield server


@pytest.fixture(scope="module")
def remote_receiver(hosts: TwoHosts, vllm_model_dir: Path) -> Iterator[ReceiverProcess]:
    """The reference receiver serving the same checkpoint, on the other host."""
    with start_receiver(
        "", extra_args=("--model", str(vllm_model_dir), "--host", hosts.there), wrapper=hosts.run_there
    ) as receiver:
        yield receiver


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = toy_task.build_tokenizer()
    return [tokenizer(prompt)["input_ids"] for prompt, _ in toy_task.held_out_prompts(4)]


def trainer_model(model_dir: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def new_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights no server holds yet."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))


def test_a_failed_connect_raises_the_python_error_and_exits_with_it(
    hosts: TwoHosts, remote_vllm: VLLMServer, remote_receiver: ReceiverProcess, vllm_model_dir: Path
) -> None:
    servers = [remote_vllm.url, remote_receiver.url]
    # Loopback towards another host is refused before any server is called.
    with pytest.raises(
        ValueError,
        match=rf"master_address='127\.0\.0\.1' is this host's loopback, which the server at {hosts.there} "
        rf"\(another host\) cannot reach: leave master_address out \(the trainer then advertises {hosts.here},",
    ):
        WeightTransferTrainerFactory.trainer_init(
            "torch_dist", {"timeout_s": 30}, {"master_address": "127.0.0.1", "rank": 0},
            client=HTTPVLLMWeightSyncClient(servers), source=ModuleSource(trainer_model(vllm_model_dir)),
        )  # fmt: skip
    # An address of this host the servers have no route to: the servers fail
    # to connect, and the trainer's process ends with that error (status 1).
    # It used to abort at exit instead (std::terminate, status 134): the
    # group's join was still in gloo's C++ code on a daemon thread.
    run = subprocess.run(
        [sys.executable, "-c", FAILED_CONNECT, *servers, hosts.unreachable],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert "terminate called" not in run.stderr, run.stderr[-3000:]
    assert run.returncode == 1, run.stderr[-3000:]
    assert "\nwt_callbacks.transfer.errors.WeightTransferError: weight sync connecting to the servers failed" in run.stderr
    assert f"cannot reach the trainer's rendezvous store at {hosts.unreachable}:" in run.stderr


def test_servers_on_another_host_need_only_their_urls(
    hosts: TwoHosts, remote_vllm: VLLMServer, remote_receiver: ReceiverProcess, vllm_model_dir: Path, prompts
) -> None:
    """Runs after the failed connect above: every server takes the next correct round."""
    port = remote_vllm.url.rsplit(":", 1)[1]
    with pytest.raises(requests.ConnectionError):  # two hosts indeed: not on this host's loopback
        requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
    model = trainer_model(vllm_model_dir)
    new_weights(model, seed=1)
    sync = WeightSync(SyncConfig(servers=[remote_vllm.url, remote_receiver.url], timeout_s=60))
    sync.setup(model)
    try:
        assert sync.engine.worker_init_info["master_address"] == hosts.here
        assert sync.engine.group.transport == "gloo"
        assert max_logprob_diff(remote_vllm, model, prompts) > 100 * FP32_ATOL, "the server holds these weights already"
        for step in (1, 2):
            new_weights(model, seed=1 + step)
            assert sync.maybe_sync(step)
            assert max_logprob_diff(remote_vllm, model, prompts) <= FP32_ATOL
            assert remote_receiver.checksums() == module_checksums(model)
    finally:
        sync.close()


def test_servers_reached_from_two_addresses_of_this_host_need_a_master_address(hosts: TwoHosts) -> None:
    """No one address of this host is known to reach both: refused before any server is called."""
    second_here = hosts.second_network.rsplit(".", 1)[0] + ".1"
    client = HTTPVLLMWeightSyncClient([f"http://{hosts.there}:1", f"http://{hosts.second_network}:1"])
    with pytest.raises(
        ValueError,
        match=rf"the servers are reached from different addresses of this host \({hosts.here} for {hosts.there}; "
        rf"{second_here} for {hosts.second_network}\), and none is known to reach all of them: set "
        r"init_info.master_address",
    ):
        WeightTransferTrainerFactory.trainer_init(
            "torch_dist", {"timeout_s": 5}, {"rank": 0}, client=client, source=ModuleSource(torch.nn.Linear(2, 2))
        )
