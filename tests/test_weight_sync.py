"""WeightSync end to end: checkpoint names, rounds into a real receiver, failures, FSDP2 on 2 ranks."""

import dataclasses
import datetime
import json
import logging
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel

from wt_callbacks.checksums import module_checksums
from wt_callbacks.config import SyncConfig
from wt_callbacks.demos.multiprocess import free_port, leave_group_together
from wt_callbacks.naming import checkpoint_name, find_submodule
from wt_callbacks.receiver import Receiver
from wt_callbacks.sync import Collectives, WeightSync
from wt_callbacks.transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferError

TIMEOUT_S = 20


class Block(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(hidden, hidden)
        self.mlp = torch.nn.Linear(hidden, hidden, bias=False)


class Backbone(torch.nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(Block(hidden) for _ in range(2))
        self.norm = torch.nn.LayerNorm(hidden)


class TinyLM(torch.nn.Module):
    """Names like a transformers CausalLM checkpoint: ``model.layers.0...``, ``lm_head.weight``."""

    def __init__(self, hidden: int = 5, vocab: int = 7) -> None:
        super().__init__()
        self.model = Backbone(hidden, vocab)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)


class Policy(torch.nn.Module):
    """What a LightningModule holds: the served model plus trainer-only parts."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM()
        self.value_head = torch.nn.Linear(5, 1)


def tiny_lm(seed: int, **kwargs: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def policy(seed: int) -> Policy:
    torch.manual_seed(seed)
    return Policy()


LM_NAMES = [n for n, _ in TinyLM().named_parameters()]


def served_info(url: str) -> dict:
    client = HTTPVLLMWeightSyncClient(url, timeout=TIMEOUT_S)
    try:
        return client.weight_info()[0]
    finally:
        client.close()


def config(url: str, **kwargs) -> SyncConfig:
    """Sends ``Policy.model`` unless ``module=`` says otherwise."""
    return SyncConfig(**{"servers": [url], "module": "model", "timeout_s": TIMEOUT_S, **kwargs})


# --------------------------------------------------------------------------- #
# Checkpoint names
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "raw, expected",
    [
        # DDP's `module` is unwrapped, never stripped: this one is the model's own attribute.
        ("module.model.layers.0.attn.weight", "module.model.layers.0.attn.weight"),
        ("_orig_mod.lm_head.weight", "lm_head.weight"),
        ("model.layers.0._orig_mod.attn.weight", "model.layers.0.attn.weight"),
        ("_fsdp_wrapped_module.model._fsdp_wrapped_module.norm.bias", "model.norm.bias"),
        ("model.layers.1._checkpoint_wrapped_module.mlp.weight", "model.layers.1.mlp.weight"),
        ("_forward_module.model.lm_head.weight", "model.lm_head.weight"),
        ("lm_head.weight_orig_mod", "lm_head.weight_orig_mod"),  # whole segments only
    ],
)
def test_checkpoint_name(raw, expected):
    assert checkpoint_name(raw) == expected


@pytest.fixture
def single_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_models_own_module_attribute_is_named_alike_with_and_without_ddp(single_process_group):
    """DDP's wrapper is unwrapped, not a leading `module` segment dropped: a
    model's own `module` attribute is named the same on one device and under
    DDP (one device dropped the segment, DDP kept it), and module= reaches it
    under both."""
    model = torch.nn.Module()
    model.module = torch.nn.Linear(2, 2)
    model.head = torch.nn.Linear(2, 1)
    for held in (model, DistributedDataParallel(model), torch.compile(DistributedDataParallel(model))):
        assert [m.name for m in ModuleSource(held).metadata()] == ["module.weight", "module.bias", "head.weight", "head.bias"]
        assert [m.name for m in ModuleSource(held, submodule="module").metadata()] == ["weight", "bias"]


def test_names_through_ddp_compile_and_checkpoint_wrappers(single_process_group):
    trainer = policy(1)
    layers = trainer.model.model.layers
    layers[0] = torch.compile(layers[0])  # regional compilation: `_orig_mod` mid-name
    layers[1] = checkpoint_wrapper(layers[1])
    wrapped = torch.compile(DistributedDataParallel(trainer))
    assert any("_orig_mod.module.model" in n for n, _ in wrapped.named_parameters())
    source = ModuleSource(wrapped, submodule="model")
    assert [m.name for m in source.metadata()] == LM_NAMES
    assert all(t is p.detach() or t.data_ptr() == p.data_ptr() for (_, t), p in zip(source, trainer.model.parameters()))
    whole = [m.name for m in ModuleSource(wrapped).metadata()]
    assert whole == [f"model.{n}" for n in LM_NAMES] + ["value_head.weight", "value_head.bias"]


def test_find_submodule_typo_suggests():
    with pytest.raises(ValueError, match=r"module='modle': Policy has no submodule 'modle'; did you mean 'model'\?"):
        find_submodule(policy(1), "modle")
    with pytest.raises(ValueError, match=r"module='xyz': Policy has no submodule 'xyz'; its top-level submodules are \['model', 'value_head'\]"):
        find_submodule(policy(1), "xyz")
    assert find_submodule(policy(1), "model.lm_head").out_features == 7


def test_include_exclude_fnmatch(caplog):
    source = ModuleSource(
        policy(1), submodule="model", include=["model.layers.*", "lm_head.*", "nothing.*"], exclude=["*.bias"]
    )
    assert [m.name for m in source.metadata()] == [
        "model.layers.0.attn.weight",
        "model.layers.0.mlp.weight",
        "model.layers.1.attn.weight",
        "model.layers.1.mlp.weight",
        "lm_head.weight",
    ]
    assert "include pattern 'nothing.*' matches none of the sent names" in caplog.text
    with pytest.raises(ValueError, match=r"nothing to send: module='model' include=\['x\*'\] exclude=\[\] select none of the 10 parameters .*fix include / exclude / module"):
        ModuleSource(policy(1), submodule="model", include=["x*"])


def test_two_parameters_with_one_name_are_refused():
    # A root child called `_orig_mod` reads as torch.compile's wrapper, so its lm_head meets the root's.
    clash = torch.nn.Module()
    clash.lm_head = torch.nn.Linear(2, 2, bias=False)
    clash._orig_mod = torch.nn.Module()
    clash._orig_mod.lm_head = torch.nn.Linear(2, 2, bias=False)
    with pytest.raises(ValueError, match=r"parameters 'lm_head.weight' and '_orig_mod.lm_head.weight' both become 'lm_head.weight' once wrapper prefixes are stripped; send only one of them with module= or exclude="):
        ModuleSource(clash)


def test_source_casts_and_agrees_with_metadata():
    trainer = policy(1)
    source = ModuleSource(trainer, submodule="model", exclude=["*.bias"])
    cast = source.with_wire_dtype(torch.bfloat16)
    metas = cast.metadata()
    items = list(cast)
    assert [m.name for m in metas] == [n for n, _ in items] == [n for n in LM_NAMES if not n.endswith(".bias")]
    assert {m.dtype for m in metas} == {t.dtype for _, t in items} == {torch.bfloat16}
    assert [m.shape for m in metas] == [tuple(t.shape) for _, t in items]
    assert torch.equal(items[-1][1], trainer.model.lm_head.weight.detach().to(torch.bfloat16))


# --------------------------------------------------------------------------- #
# Rounds into a reference receiver
# --------------------------------------------------------------------------- #


@pytest.fixture
def receiver():
    with Receiver(tiny_lm(0)) as r:
        r.start()
        yield r


def test_rounds_cadence_and_state(receiver):
    trainer = policy(1)
    ws = WeightSync(config(receiver.url, every_n_train_steps=2))
    ws.setup(trainer)
    try:
        first = ws.sync_at_fit_start(0)
        assert first is not None and first.version == "step-0"
        assert module_checksums(receiver.model) == module_checksums(trainer.model)
        nbytes = sum(p.numel() * 4 for p in trainer.model.parameters())
        assert first.bytes == nbytes and first.gbps > 0 and first.pause_seconds > 0
        assert first.seconds >= first.gather_seconds + first.transfer_seconds

        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(1.0)
        assert [ws.maybe_sync(step) for step in (1, 2, 2, 3, 4)] == [False, True, False, False, True]
        assert ws.maybe_sync(4, epoch_end=True) is False
        assert ws.sync_at_train_end(4) is None  # step 4 is on the servers already
        assert module_checksums(receiver.model) == module_checksums(trainer.model)
        info = served_info(receiver.url)
        assert info["version_history"] == ["step-0", "step-2", "step-4"]
        assert info["weight_version"] == "step-4"
        assert HTTPVLLMWeightSyncClient(receiver.url).is_paused() == [False]
        assert ws.last_result is not None and ws.last_result.step == 4
        assert ws.last_result.metrics()["weight_sync/bytes"] == nbytes

        state = ws.state_dict()
        assert state["syncs_completed"] == 3 and state["last_synced_step"] == 4
        assert state["epochs_completed"] == 1 and state["last_sync_time"] <= time.time()
    finally:
        ws.close()
    restored = WeightSync(ws.config)
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    with pytest.raises(ValueError, match=r"weight sync state: unknown keys \['step'\]"):
        restored.load_state_dict({"step": 3})


def test_bf16_wire_with_exclude():
    """``exclude`` drops what the server does not serve (here the trainer's
    biases); a round that left out a tensor it serves would be refused."""
    served = tiny_lm(0)
    for layer in served.modules():
        if getattr(layer, "bias", None) is not None:
            layer.bias = None
    trainer = policy(1)
    with Receiver(served) as receiver:
        ws = WeightSync(config(receiver.start(), dtype="bfloat16", exclude=["*.bias"], every_n_epochs=2))
        ws.setup(trainer)
        try:
            assert [ws.maybe_sync(3, epoch_end=True), ws.maybe_sync(7), ws.maybe_sync(7, epoch_end=True)] == [False, False, True]
            result = ws.last_result
            assert result is not None and result.version == "step-7"
        finally:
            ws.close()
    sent = module_checksums(trainer.model, via_dtype=torch.bfloat16)
    after = module_checksums(served)
    assert list(after) == [name for name in LM_NAMES if not name.endswith(".bias")]
    assert after == {name: sent[name] for name in after}
    assert result.bytes == sum(p.numel() * 2 for n, p in trainer.model.named_parameters() if not n.endswith(".bias"))


def test_epochs_counted_by_the_framework_win(receiver):
    """``epochs_done`` (Lightning's count) decides, whatever this driver counted before."""
    ws = WeightSync(config(receiver.url, every_n_epochs=2))
    ws.setup(policy(1))
    try:
        assert ws.maybe_sync(3, epoch_end=True, epochs_done=3) is False
        assert ws.maybe_sync(6, epoch_end=True, epochs_done=4) is True
        assert ws.state_dict()["epochs_completed"] == 4
    finally:
        ws.close()
    assert served_info(receiver.url)["version_history"] == ["step-6"]


@pytest.mark.parametrize("key", ["every_n_train_steps", "every_n_epochs"])
def test_zero_cadence_syncs_only_when_asked(receiver, key):
    ws = WeightSync(config(receiver.url, **{key: 0}))
    ws.setup(policy(1))
    try:
        assert not any(ws.maybe_sync(step) or ws.maybe_sync(step, epoch_end=True) for step in range(1, 5))
        assert ws.sync(4, "asked") is not None and ws.sync_at_train_end(5) is not None
    finally:
        ws.close()
    assert served_info(receiver.url)["version_history"] == ["asked", "step-5"]


def test_time_interval_decides_from_now(receiver):
    ws = WeightSync(config(receiver.url, train_time_interval=60, pause="none"))
    ws.setup(policy(1))
    try:
        later = time.monotonic() + 61
        assert ws.maybe_sync(1) is False
        assert ws.maybe_sync(2, now=later) is True
        assert ws.maybe_sync(2, now=later + 61) is False  # same optimizer step
        assert ws.maybe_sync(3, now=later + 1) is False  # the interval restarted at the round
        assert ws.last_result is not None and ws.last_result.pause_seconds == 0
    finally:
        ws.close()
    assert served_info(receiver.url)["version_history"] == ["step-2"]


def test_warn_keeps_training_and_reconnects_on_the_same_port(caplog):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    trainer = policy(1)
    ws = WeightSync(config(url, on_error="warn"))
    ws.setup(trainer)  # no server yet: a warning, not an error
    assert ws.engine is None
    assert "weight sync connecting to the servers failed on trainer rank 0" in caplog.text
    try:
        first = Receiver(tiny_lm(0))
        first.start(port=port)
        try:
            assert ws.sync(1) is not None
        finally:
            first.stop()
        caplog.clear()
        assert ws.sync(2) is None
        assert ws.engine is None
        # The failed connect in setup was no round; the failed round counts.
        assert ws.gauges(2) == {"weight_sync/failures": 1.0, "weight_sync/steps_behind": 1.0}
        warning = [r for r in caplog.records if r.levelno == logging.WARNING and "round for step" in r.message]
        assert len(warning) == 1
        assert "weight sync round for step 2 (version 'step-2') failed on trainer rank 0: WeightSyncHTTPError" in warning[0].message
        assert "cannot reach the server" in warning[0].message
        assert "reconnecting at the next due round" in warning[0].message

        with Receiver(tiny_lm(2)) as second:
            second.start(port=port)
            result = ws.sync(3)
            assert result is not None and result.version == "step-3"
            assert served_info(url)["version_history"] == ["step-3"]
            assert module_checksums(second.model) == module_checksums(trainer.model)
        assert ws.state_dict()["syncs_completed"] == 2
    finally:
        ws.close()


def test_raise_on_dead_server_and_on_a_rejected_update():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(WeightTransferError, match=r"weight sync connecting to the servers failed on trainer rank 0: WeightSyncHTTPError: GET http://127\.0\.0\.1:\d+/get_world_size: cannot reach the server.*Set on_error: warn"):
        WeightSync(config(url)).setup(policy(1))

    with Receiver(tiny_lm(0, hidden=6)) as mismatched:
        mismatched.start()
        ws = WeightSync(config(mismatched.url))
        ws.setup(policy(1))
        try:
            with pytest.raises(WeightTransferError, match=r"weight sync round for step 5 \(version 'step-5'\) failed on trainer rank 0: WeightTransferError: update_weights failed on the server: .*shape mismatch for 'model.embed_tokens.weight'"):
                ws.sync(5)
            assert ws.engine is None
            assert HTTPVLLMWeightSyncClient(mismatched.url).is_paused() == [False]
            assert served_info(mismatched.url)["updates_completed"] == 0
        finally:
            ws.close()


def test_failed_send_frees_a_fixed_master_port_at_once(caplog):
    with Receiver(tiny_lm(0, hidden=6)) as mismatched:
        mismatched.start()
        ws = WeightSync(config(mismatched.url, on_error="warn", init_info={"master_port": free_port()}))
        ws.setup(policy(1))
        try:
            assert ws.sync(1) is None
            caplog.clear()
            assert ws.sync(2) is None  # reconnects on the same master_port, fails on the shapes again
        finally:
            ws.close()
    assert "shape mismatch for 'model.embed_tokens.weight'" in caplog.text
    assert "address already in use" not in caplog.text


def test_setup_arguments_are_checked(receiver):
    ws = WeightSync(config(receiver.url))
    with pytest.raises(ValueError, match=r"world_size=2: pass collectives= built from the framework's strategy"):
        ws.setup(policy(1), 1, 2)
    with pytest.raises(ValueError, match=r"rank=2 must be in 0\.\.world_size-1 \(world_size=2\)"):
        ws.setup(policy(1), 2, 2, collectives=Collectives(broadcast=lambda o: o, any_flag=lambda f: f))
    with pytest.raises(RuntimeError, match=r"call setup\(module, rank, world_size\) before sync\(\)"):
        ws.sync(1)
    with pytest.raises(ValueError, match=r"module='modle': Policy has no submodule"):
        WeightSync(config(receiver.url, module="modle")).setup(policy(1))


# --------------------------------------------------------------------------- #
# FSDP2, two trainer ranks
# --------------------------------------------------------------------------- #


def _fsdp_rank(rank: int, world_size: int, pg_port: int, good_url: str, bad_url: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    out: dict = {}
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        model = tiny_lm(1)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert type(model.lm_head.weight).__name__ == "DTensor"
        collectives = Collectives.from_torch_distributed()

        # Small buckets: several packed chunks, each interleaved with gathers.
        good = config(good_url, module=None, dtype="bfloat16", config={"packed_buffer_size_bytes": 64})
        ws = WeightSync(good)
        ws.setup(model, rank, world_size, collectives=collectives)
        result = ws.sync_at_fit_start(0)
        out["fit_start"] = dataclasses.asdict(result) if result else None
        out["checksums"] = module_checksums(model, via_dtype=torch.bfloat16)
        ws.close()

        # Rank 0 alone decides a time trigger; rank 1's clock says "due" and must not matter.
        ws = WeightSync(dataclasses.replace(good, train_time_interval=3600))
        ws.setup(model, rank, world_size, collectives=collectives)
        far = time.monotonic() + 1e6
        out["time_due"] = [
            ws.maybe_sync(1, now=None if rank == 0 else far),
            ws.maybe_sync(2, now=far if rank == 0 else None),
        ]
        ws.close()

        # The server rejects the update mid-round: no deadlock, every rank takes the same branch.
        bad = dataclasses.replace(good, servers=[bad_url], on_error="warn")
        ws = WeightSync(bad)
        ws.setup(model, rank, world_size, collectives=collectives)
        out["warn"] = [ws.sync(3), ws.sync(4)]
        ws.close()
        ws = WeightSync(dataclasses.replace(bad, on_error="raise"))
        ws.setup(model, rank, world_size, collectives=collectives)
        try:
            ws.sync(5)
        except WeightTransferError as e:
            out["raised"] = str(e)
        ws.close()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        leave_group_together()


@pytest.mark.slow
def test_fsdp2_two_ranks(tmp_path):
    served = tiny_lm(0)
    with Receiver(served) as good, Receiver(tiny_lm(0, hidden=6)) as bad:
        good.start()
        bad.start()
        mp.spawn(_fsdp_rank, args=(2, free_port(), good.url, bad.url, str(tmp_path)), nprocs=2, join=True)
        info = served_info(good.url)
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    trainer_sums = outs[0]["checksums"]
    assert outs[1]["checksums"] == trainer_sums
    assert module_checksums(served) == trainer_sums
    assert info["version_history"] == ["step-0", "step-2"]
    nbytes = sum(p.numel() * 2 for p in TinyLM().parameters())
    assert outs[0]["fit_start"]["bytes"] == nbytes and outs[1]["fit_start"]["bytes"] == 0
    for out in outs:
        assert out["fit_start"]["version"] == "step-0"
        assert out["time_due"] == [False, True]
        assert out["warn"] == [None, None]
        assert "weight sync round for step 5 (version 'step-5') failed on trainer rank 0: WeightTransferError: update_weights failed on the server" in out["raised"]
        assert "shape mismatch for 'model.embed_tokens.weight'" in out["raised"]
