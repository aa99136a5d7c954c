"""Verification: after a round, the servers' greedy logprobs on fixed probes
against the trainer model's (``verify_every_n_syncs``, ``sync(verify=True)``).

Against reference receivers in their own processes (one in this process,
to alter what it serves), serving a tiny MoE from token-id prompts (no
tokenizer on either side), as they would a vLLM server.
"""

from __future__ import annotations

import pytest

from wt_callbacks.checksums import module_checksums
from wt_callbacks.config import SyncConfig
from wt_callbacks.demos.models import tiny_mlp
from wt_callbacks.demos.tiny_lms import TINY_LMS
from wt_callbacks.receiver import Receiver
from wt_callbacks.sync import WeightSync
from wt_callbacks.transfer import WeightTransferError
from wt_callbacks.verify import ProbeSet, max_logprob_diff, served_logprob_diff, teacher_forced_logprobs

FACTORY = "wt_callbacks.demos.tiny_lms:qwen3_moe"


def sync_config(url: str, **kwargs) -> SyncConfig:
    return SyncConfig(servers=[url], timeout_s=30, pause="none", **kwargs)


def test_every_kth_round_is_verified_and_logged(receiver_proc):
    receiver = receiver_proc(FACTORY)
    model = TINY_LMS["qwen3_moe"](seed=0)
    assert served_logprob_diff(model, receiver.url)[receiver.url] > 0.1  # another model is served
    ws = WeightSync(sync_config(receiver.url, verify_every_n_syncs=2))
    ws.setup(model)
    try:
        results = [ws.sync(step) for step in (1, 2, 3, 4)]
    finally:
        ws.close()
    diffs = [r.verify_max_logprob_diff for r in results]
    assert diffs[0] is None and diffs[2] is None
    assert diffs[1] is not None and diffs[1] < 1e-4 and diffs[3] < 1e-4
    assert "weight_sync/verify_max_logprob_diff" in results[1].metrics()
    assert "weight_sync/verify_max_logprob_diff" not in results[0].metrics()
    assert "verified: max logprob diff" in results[1].summary()


def test_a_server_that_computes_otherwise_fails_verification(caplog):
    """A server whose model differs from the trainer's in what no round sends
    (its rotary frequencies, a buffer, as a wrong rope_theta makes them):
    every call succeeded, the check does not. The receiver runs in this
    process, to alter the model it serves; a round that leaves a served
    parameter stale it refuses itself."""
    served = TINY_LMS["qwen3_moe"]()
    served.model.rotary_emb.inv_freq.mul_(4)
    model = TINY_LMS["qwen3_moe"](seed=0)
    with Receiver(served) as receiver:
        url = receiver.start()
        ws = WeightSync(sync_config(url))
        ws.setup(model)
        try:
            with pytest.raises(WeightTransferError, match=r"verification failed: .* serves logprobs up to .* nats away from the trainer's model on the probe prompts \(verify_tolerance 0.001\)"):
                ws.sync(1, verify=True)
            assert ws.last_synced_step is None  # the round is not counted as done
            warn = WeightSync(sync_config(url, on_error="warn"))
            warn.setup(model)
            assert warn.sync(2, verify=True) is None
            assert "verification failed" in caplog.text
            warn.close()
        finally:
            ws.close()
        # The server keeps serving (the trainer's weights, its own frequencies).
        assert module_checksums(served) == module_checksums(model)
        assert served_logprob_diff(model, url)[url] > 1e-3


def test_bf16_wire_gets_its_own_default_tolerance(receiver_proc):
    receiver = receiver_proc(FACTORY)
    model = TINY_LMS["qwen3_moe"](seed=0)
    ws = WeightSync(sync_config(receiver.url, dtype="bfloat16", verify_every_n_syncs=1))
    ws.setup(model)
    try:
        result = ws.sync(1)
    finally:
        ws.close()
    assert result is not None and 1e-4 < result.verify_max_logprob_diff < 0.1


def test_setup_refuses_what_cannot_be_verified(receiver_proc):
    receiver = receiver_proc("wt_callbacks.demos.models:tiny_mlp")
    ws = WeightSync(sync_config(receiver.url, verify_every_n_syncs=1))
    with pytest.raises(ValueError, match=r"TinyMLP is not a causal LM with an output head .* set module: to the submodule that is the served transformers model, or turn verification off"):
        ws.setup(tiny_mlp(seed=0))
    with pytest.raises(ValueError, match=r"verify_every_n_syncs: verification asks the servers for completions over HTTP; it needs servers"):
        SyncConfig(ray_actors=["llm"], verify_every_n_syncs=1)
    for tolerance in (0, float("nan"), float("inf")):  # NaN or inf would pass every round
        with pytest.raises(ValueError, match=rf"verify_tolerance={tolerance!r} must be a positive number"):
            sync_config(receiver.url, verify_tolerance=tolerance)


def test_probes_are_fixed_and_inside_the_vocabulary():
    a, b = ProbeSet.for_vocab(300), ProbeSet.for_vocab(300)
    assert a == b and len(a.prompts) == 4
    assert all(4 <= t < 300 for p in a.prompts for t in p)


def test_a_server_answering_nan_logprobs_fails_any_tolerance():
    """Weights gone NaN serve NaN logprobs; max() would keep 0 over them and
    NaN > tolerance is false, so the round would pass."""
    model = TINY_LMS["qwen3_moe"](seed=0)
    probes = ProbeSet.for_vocab(model.config.vocab_size)
    tokens = [5, 6, 7]
    good = [(tokens, teacher_forced_logprobs(model, p, tokens)) for p in probes.prompts]
    nan = [(tokens, [float("nan")] * 3) for _ in probes.prompts]
    diffs = max_logprob_diff(model, probes, {"good": good, "nan": nan})
    assert diffs["good"] < 1e-6 and diffs["nan"] == float("inf")
