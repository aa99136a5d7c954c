"""Contracts of the weight-transfer API, each error message included."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests
import torch

from tests.support import REPO_ROOT
from tests.support.transfer import connect
from wt_callbacks.checksums import module_checksums
from wt_callbacks.demos import models
from wt_callbacks.demos.multiprocess import free_port
from wt_callbacks.demos.tiny_lms import TINY_LMS
from wt_callbacks.receiver import Receiver
from wt_callbacks.transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    ParamMeta,
    VLLMWeightSyncClient,
    WeightSource,
    WeightSyncHTTPError,
    WeightTransferError,
    WeightTransferConfig,
    WeightTransferEngine,
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
    materialize_full_tensor,
)
from wt_callbacks.transfer.backends.torch_dist import (
    TorchDistTrainerConfig,
    TorchDistTrainerInitInfo,
    TorchDistWeightTransferEngine,
    TorchDistWeightTransferUpdateInfo,
    TransferGroup,
)
from wt_callbacks.transfer.base import finish_with_version
from wt_callbacks.transfer.server_group import assign_rank_offsets
from wt_callbacks.transfer.packing import CastPart, broadcast_packed, plan_chunks, receive_packed
from wt_callbacks.receiver import _host_config

LOCAL = {"master_address": "127.0.0.1", "master_port": 0, "rank": 0}


# --------------------------------------------------------------------------- #
# Factories
# --------------------------------------------------------------------------- #


def test_unknown_backend_lists_the_available_ones():
    with pytest.raises(ValueError, match=r"Invalid weight transfer backend: 'nccll'. Available trainer engines: \['ipc', 'nccl', 'torch_dist'\]"):
        WeightTransferTrainerFactory.trainer_init("nccll", {}, LOCAL, client=None, source=None)
    with pytest.raises(ValueError, match=r"Available engines: \['torch_dist'"):
        WeightTransferEngineFactory.create_engine(WeightTransferConfig("nope"), _host_config(), torch.device("cpu"), None)


def test_duplicate_registration_is_refused():
    with pytest.raises(ValueError, match="'torch_dist' is already registered"):
        WeightTransferTrainerFactory.register_engine("torch_dist", TorchDistTrainerWeightTransferEngineAlias)
    with pytest.raises(ValueError, match="'torch_dist' is already registered"):
        WeightTransferEngineFactory.register_engine("torch_dist", TorchDistWeightTransferEngine)


TorchDistTrainerWeightTransferEngineAlias = WeightTransferTrainerFactory.engine_class("torch_dist")


def test_lazy_registration_needs_a_class_name_and_imports_on_use():
    with pytest.raises(ValueError, match="class_name is required"):
        WeightTransferTrainerFactory.register_engine("lazy-test", "some.module")
    WeightTransferTrainerFactory.register_engine(
        "lazy-test", "wt_callbacks.transfer.backends.torch_dist", "TorchDistTrainerWeightTransferEngine"
    )
    WeightTransferEngineFactory.register_engine("direct-test", TorchDistWeightTransferEngine)
    try:
        assert WeightTransferTrainerFactory.engine_class("lazy-test") is TorchDistTrainerWeightTransferEngineAlias
        engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig("direct-test"), _host_config(), torch.device("cpu"), torch.nn.Linear(2, 2)
        )
        assert isinstance(engine, TorchDistWeightTransferEngine)
    finally:  # the registries are process-wide: leave them as other tests expect
        WeightTransferTrainerFactory._registry.pop("lazy-test")
        WeightTransferEngineFactory._registry.pop("direct-test")


def test_released_vllm_call_form_names_the_backend_in_the_init_info():
    """``trainer_init(init_info, *, client, source)`` as released vLLM calls it: the
    flat init info carries the rendezvous and the wire settings, and the seed's
    form keeps working next to it."""
    from wt_callbacks.checksums import module_checksums

    trainer_model, served_model = models.tiny_mlp(seed=0), models.tiny_mlp(seed=1)
    with Receiver(served_model) as served:
        client = HTTPVLLMWeightSyncClient(served.start(), timeout=30)
        info = {"backend": "torch_dist", **LOCAL, "packed": True, "packed_buffer_size_bytes": 1 << 20, "timeout_s": 30}
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(trainer_model))
        assert engine.config.packed_buffer_size_bytes == 1 << 20
        engine.send_weights("step-1")
        engine.shutdown()
        # This project's own init info dataclass names its backend as vLLM's do.
        engine = WeightTransferTrainerFactory.trainer_init(
            TorchDistTrainerInitInfo(**LOCAL), client=client, source=ModuleSource(trainer_model)
        )
        engine.send_weights("step-2")
        engine.shutdown()
        assert served.core.version_history == ["step-1", "step-2"]
        assert module_checksums(served_model) == module_checksums(trainer_model)
    source = ModuleSource(trainer_model)
    with pytest.raises(ValueError, match=r"a dict init info must name its backend, e.g. \{'backend': 'torch_dist'"):
        WeightTransferTrainerFactory.trainer_init(LOCAL, client=client, source=source)
    with pytest.raises(ValueError, match=r"unknown key 'master_adress'; did you mean 'master_address'\? \(accepted keys: \['all_or_nothing', 'dtype', 'master_address'"):
        WeightTransferTrainerFactory.trainer_init({"backend": "torch_dist", "master_adress": "x"}, client=client, source=source)
    with pytest.raises(ValueError, match=r"init_info of type object names no backend"):
        WeightTransferTrainerFactory.trainer_init(object(), client=client, source=source)
    with pytest.raises(TypeError, match=r"trainer_init\(\) is missing \['init_info'\]"):
        WeightTransferTrainerFactory.trainer_init("torch_dist", {}, client=client, source=source)


# --------------------------------------------------------------------------- #
# Config / init_info parsing (dicts from YAML, with errors naming the key)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"pakced": True}, r"unknown key 'pakced'; did you mean 'packed'\?"),
        ({"packed": "yes"}, r"key 'packed' must be of type <class 'bool'>"),
        ({"packed_buffer_size_bytes": 0}, r"packed_buffer_size_bytes=0 must be a positive integer"),
        ({"packed_num_buffers": -1}, r"packed_num_buffers=-1 must be a positive integer"),
        ({"dtype": "bfloat61"}, r"dtype='bfloat61' is not a torch dtype name; did you mean 'bfloat16'\?"),
        ({"dtype": "int8"}, r"dtype='int8': the wire dtype must be a floating-point dtype"),
        ({"timeout_s": 0}, r"timeout_s=0 must be a positive number of seconds"),
        ({"transport": "mpi"}, r"transport='mpi' is not one of"),
        ({"backend": "nccl"}, r"backend must be 'torch_dist'"),
    ],
)
def test_bad_trainer_config_names_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        TorchDistTrainerWeightTransferEngineAlias.parse_config(config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a trainer without CUDA")
def test_nccl_transport_without_cuda_names_the_fix():
    """Refused before any server is asked (the client here reaches nothing)."""
    client = HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{free_port()}", timeout=5)
    with pytest.raises(ValueError, match=r"transport='nccl' needs CUDA on the trainer.*'auto'.*'gloo'"):
        WeightTransferTrainerFactory.trainer_init(
            "torch_dist", {"transport": "nccl"}, LOCAL, client=client, source=ModuleSource(torch.nn.Linear(2, 2))
        )


@pytest.mark.parametrize(
    ("init_info", "message"),
    [
        ({"master_port": 1}, r"missing required key 'rank'"),
        ({**LOCAL, "master_port": 70000}, r"master_port must be in 0..65535"),
        ({**LOCAL, "rank": -1}, r"rank must be >= 0"),
        ({**LOCAL, "world_size": 1}, r"world_size must be >= 2"),
        ({**LOCAL, "master_adress": "x"}, r"did you mean 'master_address'"),
        ({**LOCAL, "master_port": "29500"}, r"key 'master_port' must be of type <class 'int'>"),
    ],
)
def test_bad_trainer_init_info_names_the_key(init_info, message):
    with pytest.raises(ValueError, match=message):
        TorchDistTrainerWeightTransferEngineAlias.parse_init_info(init_info)


def test_dataclasses_and_dicts_parse_alike():
    as_dict = TorchDistTrainerWeightTransferEngineAlias.parse_config({"packed": False, "dtype": "bfloat16"})
    as_cls = TorchDistTrainerConfig(packed=False, dtype="bfloat16")
    assert as_dict == as_cls
    assert as_cls.wire_dtype is torch.bfloat16
    assert TorchDistTrainerWeightTransferEngineAlias.parse_init_info(LOCAL) == TorchDistTrainerInitInfo(**LOCAL)
    assert TorchDistTrainerInitInfo(**LOCAL).is_sender
    assert not TorchDistTrainerInitInfo(**{**LOCAL, "rank": 1}).is_sender


def test_worker_parse_errors_name_the_key():
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(), _host_config(), torch.device("cpu"), torch.nn.Linear(2, 2)
    )
    with pytest.raises(ValueError, match=r"Invalid init_info for TorchDistWeightTransferEngine: missing required key 'rank_offset'"):
        engine.parse_init_info({"master_address": "127.0.0.1", "master_port": 1, "world_size": 2})
    with pytest.raises(ValueError, match=r"rank_offset must be >= 1"):
        engine.parse_init_info({"master_address": "a", "master_port": 1, "world_size": 2, "rank_offset": 0})
    with pytest.raises(ValueError, match=r"Invalid update_info .*unknown key 'name'; did you mean 'names'"):
        engine.parse_update_info({"name": []})
    with pytest.raises(ValueError, match=r"equal lengths, got 2, 1, 1"):
        engine.parse_update_info({"names": ["a", "b"], "dtype_names": ["float32"], "shapes": [[1]]})
    with pytest.raises(ValueError, match=r"dtype_names\[0\]='floaty' is not a torch dtype name"):
        engine.parse_update_info({"names": ["a"], "dtype_names": ["floaty"], "shapes": [[1]]})
    # What a hostile or broken caller sends gets the key, not a TypeError from deep inside.
    init = {"master_address": "a", "master_port": 1, "world_size": 2, "rank_offset": 1}
    with pytest.raises(ValueError, match=r"world_size must be >= 2 \(and <= 2147483647\), got 1099511627776"):
        engine.parse_init_info({**init, "world_size": 2**40})
    with pytest.raises(ValueError, match=r"timeout_s=1000000000000000.0 must be a positive number of seconds \(<= 1e\+09\)"):
        engine.parse_init_info({**init, "timeout_s": 1e15})
    with pytest.raises(ValueError, match=r"names\[0\] must be a tensor name \(a string\), got 7"):
        engine.parse_update_info({"names": [7], "dtype_names": ["float32"], "shapes": [[1]]})
    with pytest.raises(ValueError, match=r"shapes\[0\] \(a\) must be a list of non-negative ints, got 64"):
        engine.parse_update_info({"names": ["a"], "dtype_names": ["float32"], "shapes": [64]})
    info = engine.parse_update_info({"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]]})
    assert isinstance(info, TorchDistWeightTransferUpdateInfo) and info.dtypes == [torch.bfloat16]
    # Kept tensors are described as sent ones are, and are never sent too.
    sent = {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]]}
    info = engine.parse_update_info({**sent, "keep": {"names": ["b"], "dtype_names": ["bfloat16"], "shapes": [[4]]}})
    assert (info.kept_names, info.kept_dtypes, info.kept_shapes) == (["b"], [torch.bfloat16], [[4]])
    for keep, message in (
        ({"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]]}, r"keep.names lists 'a', which names sends"),
        ({"names": ["b", "b"], "dtype_names": ["float32"] * 2, "shapes": [[1]] * 2}, r"keep.names lists 'b' twice"),
        ({"names": ["b"], "dtype_names": ["f32"], "shapes": [[1]]}, r"keep.dtype_names\[0\]='f32' is not a torch dtype name"),
        ({"names": ["b"]}, r'keep must be \{"names": \[...\], "dtype_names"'),
    ):
        with pytest.raises(ValueError, match=message):
            engine.parse_update_info({**sent, "keep": keep})
    # A prepared round is a staged one.
    assert engine.parse_update_info({**sent, "staged": True, "prepared": True}).prepared
    with pytest.raises(ValueError, match=r"prepared: true needs staged: true"):
        engine.parse_update_info({**sent, "prepared": True})
    # A round's staging niceness: 0..19, for a staged round only; the server's floor applies.
    assert engine.staging_niceness(engine.parse_update_info({**sent, "staged": True, "staging_nice": 12})) == 12
    for nice, message in (
        (20, r"staging_nice=20 must be an integer niceness from 0 to 19"),
        (-3, r"staging_nice=-3 must be an integer niceness from 0 to 19"),
        ("5", r"key 'staging_nice' must be of type <class 'int'>, got str '5'"),
        (True, r"key 'staging_nice' must be of type <class 'int'>, got bool True"),
    ):
        with pytest.raises(ValueError, match=message):
            engine.parse_update_info({**sent, "staged": True, "staging_nice": nice})
    with pytest.raises(ValueError, match=r"staging_nice applies to a staged round \(its staging thread\): it needs staged: true"):
        engine.parse_update_info({**sent, "staging_nice": 4})


def test_staging_niceness_is_checked_when_the_worker_engine_starts(monkeypatch):
    """``WT_STAGING_NICE`` (the staging thread's niceness) fails the engine's
    start, naming it, unless it is 0..19; a staged round's thread gets it."""
    model = torch.nn.Linear(2, 2)

    def engine():
        return WeightTransferEngineFactory.create_engine(WeightTransferConfig(), _host_config(), torch.device("cpu"), model)

    for bad in ("-1", "20", "low"):
        monkeypatch.setenv("WT_STAGING_NICE", bad)
        with pytest.raises(ValueError, match=rf"WT_STAGING_NICE='{bad}' must be an integer niceness from 0 to 19"):
            engine()
    monkeypatch.setenv("WT_STAGING_NICE", "7")
    floored = engine()
    staged = {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]], "staged": True}
    for asked, runs in ((0, 7), (3, 7), (12, 12)):
        assert floored.staging_niceness(floored.parse_update_info({**staged, "staging_nice": asked})) == runs
    monkeypatch.delenv("WT_STAGING_NICE")
    assert engine()._staging_nice == 0


def test_staging_memory_is_checked_when_the_worker_engine_starts(monkeypatch):
    """``WT_STAGING_MEMORY`` fails the engine's start, naming it and what it
    takes, unless it is ``heap`` (the default) or ``mapped``."""
    model = torch.nn.Linear(2, 2)

    def engine():
        return WeightTransferEngineFactory.create_engine(WeightTransferConfig(), _host_config(), torch.device("cpu"), model)

    monkeypatch.setenv("WT_STAGING_MEMORY", "mmap")
    with pytest.raises(ValueError, match=r"WT_STAGING_MEMORY='mmap' must be one of heap, mapped"):
        engine()
    monkeypatch.setenv("WT_STAGING_MEMORY", "mapped")
    assert engine().staging_memory == "mapped"
    monkeypatch.delenv("WT_STAGING_MEMORY")
    assert engine().staging_memory == "heap"


MAPPED_PROBE = """
import torch
from wt_callbacks.host_memory import status_bytes
from wt_callbacks.integrations.vllm_cpu_tuning import keep_freed_host_memory
from wt_callbacks.transfer.packing import receive_packed

keep_freed_host_memory(torch.device("cpu"))  # the vLLM worker's malloc settings: freed memory is kept
MiB = 1 << 20
metas = [(torch.float32, [8 * MiB])] * 3  # 32 MiB each, a chunk each at 16 MiB chunks
for mapped in (False, True):
    payloads = iter([torch.full((8 * MiB,), float(i)).view(torch.uint8) for i in range(3)])
    views = list(receive_packed(
        metas, buffer_size_bytes=16 * MiB, num_buffers=2, broadcast=lambda buf: buf.copy_(next(payloads)),
        wait=lambda work: None, mapped=mapped,
    ))
    assert [float(v[-1]) for v in views] == [0.0, 1.0, 2.0]
    held = status_bytes("RssAnon")
    del views[0]  # the loader drops the first chunk's view
    print((held - status_bytes("RssAnon")) // MiB)
"""


def test_mapped_round_buffers_go_back_to_the_os_as_their_last_view_goes():
    """A round received ``mapped``: each chunk in memory of its own, which
    leaves the process the moment the loader drops the chunk's last view,
    where the heap of a vLLM worker (which keeps freed memory) keeps it; the
    views read what was received either way. A process of its own: it changes
    glibc's malloc settings."""
    probe = subprocess.run(
        [sys.executable, "-c", MAPPED_PROBE], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    heap_mib, mapped_mib = map(int, probe.stdout.split())
    assert heap_mib < 8 and mapped_mib >= 30, probe.stdout


def test_worker_engine_surface():
    model, draft = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(), _host_config(), torch.device("cpu"), model)
    assert engine.supports_draft_weight_update is True
    engine.set_weight_update_target(draft, "draft-config")
    assert engine.model is draft and engine.model_config == "draft-config"
    engine.reset_weight_update_target()
    assert engine.model is model and engine.model_config is None
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine must be called before update_weights"):
        engine.update_weights({"names": [], "dtype_names": [], "shapes": []})


class _RecordingEngine(WeightTransferEngine):
    """Minimal worker engine: proves the base ``update_weights`` runs on CPU."""

    init_info_cls = dict
    update_info_cls = TorchDistWeightTransferUpdateInfo

    def init_transfer_engine(self, init_info: Any) -> None: ...
    def start_weight_update(self) -> None: ...
    def finish_weight_update(self) -> None: ...
    def shutdown(self) -> None: ...

    def receive_weights(self, update_info: Any) -> None:
        self.received = update_info.names

    @staticmethod
    def trainer_send_weights(iterator: Iterator[Any], trainer_args: Any) -> None: ...


def test_base_update_weights_works_without_an_accelerator():
    assert not torch.accelerator.is_available()
    engine = _RecordingEngine(WeightTransferConfig("x"), _host_config(), torch.device("cpu"), torch.nn.Linear(1, 1))
    engine.update_weights({"names": ["w"], "dtype_names": ["float32"], "shapes": [[1]]})
    assert engine.received == ["w"]


# --------------------------------------------------------------------------- #
# Packing plan: vLLM's chunk cut rule
# --------------------------------------------------------------------------- #


def test_chunk_closes_after_the_tensor_that_exceeds_the_buffer():
    assert plan_chunks([4, 4, 4], 8) == [range(0, 3)]  # 8 is not > 8; 12 is
    assert plan_chunks([4, 5, 4], 8) == [range(0, 2), range(2, 3)]
    assert plan_chunks([20, 1, 1], 8) == [range(0, 1), range(1, 3)]  # oversized tensor alone
    assert plan_chunks([], 8) == []
    with pytest.raises(ValueError, match="packed_buffer_size_bytes=0 must be a positive integer"):
        plan_chunks([1], 0)


@pytest.mark.parametrize("num_buffers", [1, 2])
def test_unpacked_parts_make_the_packed_chunks_within_the_buffer_bound(num_buffers):
    """A transport that broadcasts parts gets the same chunks as the packer
    would send, and never more than num_buffers chunks are held at a time."""
    tensors = [torch.full((n,), float(i)) for i, n in enumerate([3, 5, 0, 2, 9, 1, 4])]
    nbytes = [t.numel() * 4 for t in tensors]
    chunks, held, peak = [], set(), [0]

    def broadcast_parts(parts):
        chunks.append(torch.cat([p.view(torch.uint8) for p in parts]))
        held.add(len(chunks))
        return len(chunks)

    def wait(work):
        held.discard(work)

    def gen():
        for t in tensors:
            peak[0] = max(peak[0], len(held) + 1)  # + the chunk being collected
            yield t

    sent = broadcast_packed(gen(), buffer_size_bytes=16, num_buffers=num_buffers, broadcast=None, wait=wait,
                            broadcast_parts=broadcast_parts)  # fmt: skip
    assert sent == sum(nbytes) and not held and peak[0] <= num_buffers
    expected = [torch.cat([tensors[i].view(torch.uint8) for i in chunk]) for chunk in plan_chunks(nbytes, 16)]
    assert len(chunks) == len(expected) and all(torch.equal(a, b) for a, b in zip(chunks, expected))


@pytest.mark.parametrize("loader_copies", [False, True])
def test_receive_buffers_rotate_only_for_a_loader_that_copies(loader_copies):
    """By default every chunk of a round has its own buffer, so views a loader
    keeps stay valid to the end of the round (vLLM's layerwise reload keeps a
    layer's); for a loader that copies each tensor before asking for the next,
    num_buffers + 1 buffers rotate and the cache stays that size, round after round."""
    tensors = [torch.full((n,), float(i)) for i, n in enumerate([3, 5, 2, 9, 1, 4, 6, 2])]
    nbytes = [t.numel() * 4 for t in tensors]
    payloads = [torch.cat([tensors[i].view(torch.uint8) for i in chunk]) for chunk in plan_chunks(nbytes, 16)]
    cache: list[torch.Tensor] = []
    for _ in range(2):  # the second round reuses the cached buffers
        posted = iter(payloads)

        def broadcast(buf):
            buf.copy_(next(posted))  # the data lands when the receive is posted: the worst case for reuse

        received = receive_packed(
            [(torch.float32, [t.numel()]) for t in tensors], buffer_size_bytes=16, num_buffers=2,
            broadcast=broadcast, wait=lambda work: None, buffers=cache, loader_copies=loader_copies,
        )  # fmt: skip
        kept = [t if not loader_copies else t.clone() for t in received]
        assert all(torch.equal(a, b) for a, b in zip(kept, tensors))
        assert len(cache) == (3 if loader_copies else len(payloads))


def test_a_mapped_round_comes_in_a_mapping_per_chunk_and_keeps_no_buffer():
    """``mapped``: every chunk is received into memory of its own, not into
    the buffers kept between rounds, which are let go (a loader copying
    through them kept some); a chunk of zero-size tensors maps nothing."""
    tensors = [torch.full((n,), float(i)) for i, n in enumerate([3, 5, 2, 9, 1, 4])] + [torch.empty(0)]
    metas = [(torch.float32, [t.numel()]) for t in tensors]
    nbytes = [t.numel() * 4 for t in tensors]
    chunks = plan_chunks(nbytes, 16)
    payloads = iter([torch.cat([tensors[i].view(torch.uint8) for i in chunk]) for chunk in chunks])
    posted_into = []

    def broadcast(buf):
        posted_into.append(buf.untyped_storage().data_ptr())
        buf.copy_(next(payloads))

    cache = [torch.empty(64, dtype=torch.uint8)]  # an earlier round's
    received = list(receive_packed(
        metas, buffer_size_bytes=16, num_buffers=2, broadcast=broadcast, wait=lambda work: None, buffers=cache,
        mapped=True,
    ))  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(received, tensors))
    sent = [chunk for chunk in chunks if sum(nbytes[i] for i in chunk)]
    assert len(set(posted_into)) == len(posted_into) == len(sent) and not cache


def test_a_broadcast_that_completes_as_a_wait_slice_runs_out_is_received():
    """A worker waits on a gloo broadcast in slices; a broadcast completing
    between a slice's timeout and the check after it succeeded, and is not
    failed with the slice's "Operation timed out!". A real gloo broadcast
    cannot be made to land in that window on demand, hence the stand-in work."""

    class CompletesAsTheSliceRunsOut:
        completed = False

        def wait(self, timeout=None):
            if timeout is not None and not self.completed:
                self.completed = True  # it completes right after this slice timed out
                raise RuntimeError("Operation timed out!")
            return True

        def is_completed(self):
            return self.completed

    group = TransferGroup.__new__(TransferGroup)
    group.transport, group.store = "gloo", None
    group.wait_received(CompletesAsTheSliceRunsOut())  # returns: the broadcast arrived


def test_a_store_that_does_not_answer_neither_blocks_a_wait_nor_means_the_trainer_left():
    """Between wait slices a worker asks the trainer's store whether the
    trainer left, on a thread: a store that does not answer (a frozen trainer,
    whose store never does; a loaded machine) neither blocks the wait nor
    counts as "left", and is not asked again before it answered (a TCPStore
    client takes one call at a time). The broadcast's own timeout bounds the wait."""
    answer, asked = threading.Event(), []

    class SilentStore:
        def check(self, keys):
            asked.append(keys)
            answer.wait(30)
            return False

    class ArrivesAfterSlices:
        slices = 4

        def wait(self, timeout=None):
            if timeout is not None and self.slices:
                self.slices -= 1
                raise RuntimeError("Operation timed out!")
            return True

        def is_completed(self):
            return not self.slices

    group = TransferGroup(SilentStore(), None, rank=1, world_size=2, device=torch.device("cpu"))
    waiting = threading.Thread(target=group.wait_received, args=(ArrivesAfterSlices(),), daemon=True)
    try:
        waiting.start()
        waiting.join(10)
        assert not waiting.is_alive(), "the wait blocked on the store's answer"
        deadline = time.monotonic() + 10
        while not asked and time.monotonic() < deadline:  # the question's thread may start late
            time.sleep(0.01)
        assert len(asked) == 1
    finally:
        answer.set()


def test_a_chunk_whose_every_tensor_has_a_destination_is_received_straight_into_them():
    """With a transport that receives into several tensors, a chunk all of
    whose tensors have a destination skips the receive buffer and yields the
    destinations themselves; a chunk with one tensor lacking one comes in a buffer."""
    tensors = [torch.full((n,), float(i)) for i, n in enumerate([3, 5, 2, 9, 1])]
    nbytes = [t.numel() * 4 for t in tensors]
    chunks = plan_chunks(nbytes, 16)
    payloads = iter([torch.cat([tensors[i].view(torch.uint8) for i in chunk]) for chunk in chunks])
    destinations = [torch.empty(t.shape) for t in tensors]
    destinations[chunks[1][0]] = None  # the second chunk comes in a buffer
    via_parts = []

    def broadcast(buf):
        buf.copy_(next(payloads))

    def receive_parts(parts):
        via_parts.append(len(parts))
        data, offset = next(payloads), 0
        for part in parts:
            part.copy_(data[offset : offset + part.numel()])
            offset += part.numel()

    received = list(receive_packed(
        [(torch.float32, [t.numel()]) for t in tensors], buffer_size_bytes=16, num_buffers=2,
        broadcast=broadcast, wait=lambda work: None, destinations=destinations, receive_parts=receive_parts,
    ))  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(received, tensors))
    assert via_parts == [len(chunk) for k, chunk in enumerate(chunks) if k != 1]
    direct = {i for k, chunk in enumerate(chunks) if k != 1 for i in chunk}
    assert [i for i, (r, d) in enumerate(zip(received, destinations)) if r is d] == sorted(direct)


def test_rotating_buffers_stay_apart_when_some_chunks_are_received_into_destinations():
    """Chunks received straight into their destinations leave their rotating
    slot unused; the chunks that come in buffers still never share one (the
    third chunk, in a buffer, is the largest: its buffer would fit any other)."""
    tensors = [torch.full((n,), float(i)) for i, n in enumerate([3, 5, 2, 9, 20, 1, 6, 2, 7, 3])]
    nbytes = [t.numel() * 4 for t in tensors]
    chunks = plan_chunks(nbytes, 16)
    payloads = [torch.cat([tensors[i].view(torch.uint8) for i in chunk]) for chunk in chunks]
    destinations: list[torch.Tensor | None] = [None] * len(tensors)
    for i in [*chunks[0], *chunks[1]]:  # the first two chunks go straight in
        destinations[i] = torch.empty(tensors[i].shape)
    cache: list[torch.Tensor] = []
    for _ in range(2):
        posted = iter(payloads)

        def broadcast(buf):
            buf.copy_(next(posted))  # the data lands when the receive is posted

        def receive_parts(parts):
            data, offset = next(posted), 0
            for part in parts:
                part.copy_(data[offset : offset + part.numel()])
                offset += part.numel()

        received = receive_packed(
            [(torch.float32, [t.numel()]) for t in tensors], buffer_size_bytes=16, num_buffers=2,
            broadcast=broadcast, wait=lambda work: None, buffers=cache, loader_copies=True,
            destinations=destinations, receive_parts=receive_parts,
        )  # fmt: skip
        kept = [t.clone() for t in received]
        assert all(torch.equal(a, b) for a, b in zip(kept, tensors))


@pytest.mark.parametrize("transport", ["pack buffer", "parts"])
def test_packing_casts_to_the_wire_dtype_as_it_copies(transport):
    """Tensors in another dtype than their wire dtype arrive as if cast first,
    a non-contiguous one and one at an offset not aligned to the wire dtype
    (after an odd-sized uint8 tensor) included; a transport of parts gets the
    aligned contiguous ones as ``CastPart``s, to convert as it copies."""
    torch.manual_seed(0)
    tensors = [torch.arange(3, dtype=torch.uint8), torch.randn(5), torch.randn(4), torch.randn(3, 2).t(), torch.randn(7)]
    wires = [torch.uint8, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32]
    expected = [t.to(w).contiguous().view(-1).view(torch.uint8) for t, w in zip(tensors, wires)]
    chunks, cast_parts = [], []

    def as_bytes(part):
        if isinstance(part, CastPart):
            cast_parts.append(part)
            return part.tensor.to(part.dtype).view(torch.uint8)
        return part.view(torch.uint8)

    def broadcast(buf):
        chunks.append(buf.clone())

    def broadcast_parts(parts):
        chunks.append(torch.cat([as_bytes(p) for p in parts]))

    sent = broadcast_packed(
        iter(tensors), buffer_size_bytes=10, num_buffers=2, broadcast=broadcast, wait=lambda work: None,
        capacity_hint=[64, 64], dtypes=wires, broadcast_parts=broadcast_parts if transport == "parts" else None,
    )
    nbytes = [e.numel() for e in expected]
    want = [torch.cat([expected[i] for i in chunk]) for chunk in plan_chunks(nbytes, 10)]
    assert sent == sum(nbytes)
    assert len(chunks) == len(want) and all(torch.equal(a, b) for a, b in zip(chunks, want))
    if transport == "parts":
        # Chunks: [uint8, fp32 at offset 3], [fp32 at 0, transposed], [fp32 on an fp32 wire]. Only
        # the aligned contiguous one goes as a CastPart; the others are converted first.
        assert [p.tensor.numel() for p in cast_parts] == [4]


# --------------------------------------------------------------------------- #
# Sources
# --------------------------------------------------------------------------- #


def test_module_source_metadata_matches_iteration_and_casts():
    model = models.mixed_model(seed=0)
    source = ModuleSource(model)
    items = list(source)
    assert [(m.name, m.dtype, m.shape) for m in source.metadata()] == [
        (n, t.dtype, tuple(t.shape)) for n, t in items
    ]
    bf16 = source.with_wire_dtype(torch.bfloat16)
    assert {m.dtype for m in bf16.metadata()} == {torch.bfloat16}
    assert all(t.dtype == torch.bfloat16 for _, t in bf16)
    assert source.with_wire_dtype(None) is source
    plain = torch.ones(3)
    assert materialize_full_tensor(plain) is plain


class _ListSource(WeightSource):
    def __init__(self, items):
        self.items = items

    def metadata(self):
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.items]

    def __iter__(self):
        return iter(self.items)


def _normed(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    model.register_buffer("scratch", torch.zeros(3), persistent=False)  # not in a checkpoint: not sent
    return model


def test_persistent_buffers_are_sent_as_a_checkpoint_holds_them():
    """A checkpoint holds a module's persistent buffers (BatchNorm's running
    statistics, an int64 counter among them; a MoE router's bias in
    DeepSeek-V3): they are sent after the parameters, and a receiver serving
    the same module takes them (they were left out, and the server kept its own)."""
    trainer, served = _normed(0), _normed(1)
    trainer(torch.randn(8, 4) * 3 + 1)  # train mode: the running statistics move
    source = ModuleSource(trainer)
    assert [m.name for m in source.metadata()] == list(trainer.state_dict())
    with Receiver(served) as receiver:
        receiver.start()
        client, engine = connect(receiver.url, source)
        try:
            engine.send_weights("v1")
        finally:
            engine.shutdown()
            client.close()
        assert module_checksums(served) == module_checksums(trainer)
    assert served[1].num_batches_tracked.item() == 1 and torch.equal(served[1].running_var, trainer[1].running_var)


def test_generic_sources_get_a_casting_wrapper():
    source = _ListSource([("a", torch.ones(2)), ("i", torch.ones(2, dtype=torch.int64))])
    cast = source.with_wire_dtype(torch.float16)
    assert [m.dtype for m in cast.metadata()] == [torch.float16, torch.int64]
    assert [t.dtype for _, t in cast] == [torch.float16, torch.int64]
    assert ParamMeta("a", torch.bfloat16, (3, 5)).nbytes == 30


# --------------------------------------------------------------------------- #
# Client protocol and HTTP errors
# --------------------------------------------------------------------------- #


class _SeedStyleClient:
    """The seed's four-method client: finish takes no version."""

    def __init__(self):
        self.calls = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        self.calls.append("update")

    def finish_weight_update(self):
        self.calls.append("finish")

    def update_weight_version(self, v):
        self.calls.append(f"version={v}")


def test_protocol_is_structural_and_finish_accepts_both_styles():
    seed_style = _SeedStyleClient()
    assert isinstance(seed_style, VLLMWeightSyncClient)
    assert isinstance(HTTPVLLMWeightSyncClient("http://127.0.0.1:1"), VLLMWeightSyncClient)
    assert not isinstance(object(), VLLMWeightSyncClient)
    finish_with_version(seed_style, "v3")
    finish_with_version(seed_style, None)
    assert seed_style.calls == ["finish", "version=v3", "finish"]


def test_trainer_init_refuses_a_non_client_and_a_non_source():
    with pytest.raises(ValueError, match="does not implement VLLMWeightSyncClient"):
        WeightTransferTrainerFactory.trainer_init("torch_dist", {}, LOCAL, client=object(), source=ModuleSource(torch.nn.Linear(1, 1)))
    with pytest.raises(ValueError, match="source must be a WeightSource"):
        WeightTransferTrainerFactory.trainer_init("torch_dist", {}, LOCAL, client=_SeedStyleClient(), source=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="world_size is missing and the client has no get_world_size"):
        WeightTransferTrainerFactory.trainer_init(
            "torch_dist", {}, LOCAL, client=_SeedStyleClient(), source=ModuleSource(torch.nn.Linear(1, 1))
        )


def test_rank_offsets_for_independent_servers():
    info = {"master_address": "a", "master_port": 1, "rank_offset": 1, "world_size": 7}
    assert [p["rank_offset"] for p in assign_rank_offsets(info, [2, 4])] == [1, 3]
    with pytest.raises(ValueError, match="set world_size to 7"):
        assign_rank_offsets({**info, "world_size": 5}, [2, 4])
    assert assign_rank_offsets({"packed": True}, [1, 1]) == [{"packed": True}] * 2


@pytest.fixture
def stub_server():
    """A real HTTP server answering every request with a fixed status and body."""
    seen: list[dict[str, Any]] = []
    reply = {"status": 404, "body": b'{"detail":"Not Found"}'}

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            length = int(self.headers.get("Content-Length") or 0)
            seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": self.rfile.read(length)})
            self.send_response(reply["status"])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply["body"])))
            self.end_headers()
            self.wfile.write(reply["body"])

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", reply, seen
    server.shutdown()
    server.server_close()


def test_404_says_to_enable_dev_mode(stub_server):
    url, _, _ = stub_server
    client = HTTPVLLMWeightSyncClient(url, timeout=5)
    with pytest.raises(WeightSyncHTTPError, match=r"HTTP 404: .*VLLM_SERVER_DEV_MODE=1") as err:
        client.start_weight_update()
    assert err.value.status == 404 and "Not Found" in err.value.body


def test_bearer_token_from_argument_or_env(stub_server, monkeypatch):
    url, reply, seen = stub_server
    reply.update(status=200, body=b'{"world_size": 2}')
    HTTPVLLMWeightSyncClient(url, api_key="secret").resume()
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert HTTPVLLMWeightSyncClient(url).get_world_size() == 2
    assert [s["auth"] for s in seen] == ["Bearer secret", "Bearer from-env"]
    reply.update(status=401, body=b'{"error":"Unauthorized"}')
    with pytest.raises(WeightSyncHTTPError, match="refused the token: pass api_key= or set VLLM_API_KEY"):
        HTTPVLLMWeightSyncClient(url).resume()


def test_unreachable_server_and_bad_arguments():
    with pytest.raises(WeightSyncHTTPError, match=r"http://127.0.0.1:9/start_weight_update: cannot reach the server"):
        HTTPVLLMWeightSyncClient("http://127.0.0.1:9", timeout=5).start_weight_update()
    with pytest.raises(ValueError, match="is not an http"):
        HTTPVLLMWeightSyncClient("127.0.0.1:8000")
    for twice in (["http://a:1", "http://a:1"], ["http://a:1", "http://a:1/"]):
        with pytest.raises(ValueError, match=r"base_url: the same server is listed twice"):
            HTTPVLLMWeightSyncClient(twice)
    with pytest.raises(ValueError, match=r"timeouts: unknown method names \['update'\]"):
        HTTPVLLMWeightSyncClient("http://a:1", timeouts={"update": 3})
    for value in (0, -1, "x", None, float("nan")):
        with pytest.raises(ValueError, match=rf"timeouts\['start_weight_update'\]={value!r} must be a positive number of seconds"):
            HTTPVLLMWeightSyncClient("http://a:1", timeouts={"start_weight_update": value})
    with pytest.raises(ValueError, match="pause mode 'stop' is not one of"):
        HTTPVLLMWeightSyncClient("http://a:1").pause("stop")


# --------------------------------------------------------------------------- #
# Reference receiver: vLLM's payloads, status codes and lifecycle errors
# --------------------------------------------------------------------------- #


@pytest.fixture
def receiver():
    with Receiver(torch.nn.Linear(4, 4)) as r:
        r.start()
        yield r


def test_receiver_lifecycle_misuse_answers_like_vllm(receiver):
    url = receiver.url
    client = HTTPVLLMWeightSyncClient(url, timeout=10)
    with pytest.raises(WeightSyncHTTPError, match="start_weight_update must be called before update_weights") as err:
        client.update_weights({"names": [], "dtype_names": [], "shapes": []})
    assert err.value.status == 500
    assert json.loads(err.value.body)["error"]["type"] == "InternalServerError"
    with pytest.raises(WeightSyncHTTPError, match="without an active weight update"):
        client.finish_weight_update()
    client.start_weight_update()
    with pytest.raises(WeightSyncHTTPError, match="already active. Call finish_weight_update first"):
        client.start_weight_update()
    # An update that fails ends the session, as in vLLM.
    with pytest.raises(WeightSyncHTTPError, match="init_weight_transfer_engine must be called"):
        client.update_weights({"names": [], "dtype_names": [], "shapes": []})
    with pytest.raises(WeightSyncHTTPError, match="without an active weight update"):
        client.finish_weight_update()


def test_receiver_malformed_bodies_get_400_and_leave_no_update_behind(receiver):
    """An empty update_info list, and a finish body that is not JSON or is
    nested too deeply to parse, are refused with 400 naming the problem;
    the refused update is over (the next start is no "already active")."""
    url = receiver.url
    client = HTTPVLLMWeightSyncClient(url, timeout=10)

    def refusal(reply: requests.Response) -> str:
        assert reply.status_code == 400, reply.text
        return reply.json()["error"]["message"]

    client.start_weight_update()
    assert refusal(requests.post(f"{url}/update_weights", json={"update_info": []}, timeout=5)) == (
        "update_info is an empty list; a list holds one entry per worker rank (this server has one)"
    )
    client.start_weight_update()
    for body, error in ((b"{oops", "Expecting property name"), (b"[" * 100_000 + b"]" * 100_000, "maximum recursion depth")):
        message = refusal(requests.post(f"{url}/finish_weight_update", data=body, headers={"content-type": "application/json"}, timeout=5))
        assert message.startswith('body must be {"weight_version": str} or empty; it does not parse as JSON: ' + error)
    client.finish_weight_update("v1")  # the refused finishes left the update as it was
    deep = b'{"update_info": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert refusal(requests.post(f"{url}/update_weights", data=deep, headers={"content-type": "application/json"}, timeout=5)).startswith(
        "There was an error parsing the body: maximum recursion depth exceeded"
    )
    assert receiver.core.weight_info()["version_history"] == ["v1"]


def test_receiver_routes_and_payloads(receiver):
    url = receiver.url
    assert requests.get(f"{url}/health", timeout=5).status_code == 200
    missing = requests.post(f"{url}/init_weight_transfer_engine", json={}, timeout=5)
    assert missing.status_code == 400
    bad_mode = requests.post(f"{url}/pause", params={"mode": "later"}, timeout=5)
    assert bad_mode.status_code == 400 and "later" in bad_mode.json()["error"]
    assert requests.post(f"{url}/pause", params={"mode": "keep"}, timeout=5).json() == {"status": "paused"}
    assert requests.get(f"{url}/is_paused", timeout=5).json() == {"is_paused": True}
    assert requests.post(f"{url}/resume", timeout=5).json() == {"status": "resumed"}
    assert requests.get(f"{url}/get_world_size", timeout=5).json() == {"world_size": 1}
    assert requests.post(f"{url}/update_weight_version", json={"new_version": "v9"}, timeout=5).json() == {
        "success": True,
        "new_version": "v9",
    }
    info = requests.get(f"{url}/weight_info", timeout=5).json()
    assert info == {"weight_version": "v9", "updates_completed": 0, "version_history": []}
    sums = requests.get(f"{url}/weight_checksums", timeout=5).json()
    assert sums["weight_version"] == "v9" and set(sums["checksums"]) == {"weight", "bias"}
    draft = requests.post(f"{url}/start_draft_weight_update", timeout=5)
    assert draft.status_code == 500 and "no draft model" in draft.json()["error"]["message"]


def test_receiver_completions_pause_like_vllm_0_33_and_sample(caplog):
    """Paused with abort/wait, new completions get vLLM 0.33's 503 until /resume;
    with keep they wait. ``n`` samples per prompt come in vLLM's order. A
    finished update is logged once, with its size."""
    import logging

    from wt_callbacks.demos import toy_task

    tokenizer = toy_task.build_tokenizer()
    with Receiver(toy_task.build_model(tokenizer, seed=1), tokenizer=tokenizer) as served:
        url = served.start()

        def complete(**body: Any) -> requests.Response:
            body = {"prompt": ["a b c d |", "e f g h |"], "max_tokens": 4, **body}
            return requests.post(f"{url}/v1/completions", json=body, timeout=30)

        for mode in ("abort", "wait"):
            requests.post(f"{url}/pause", params={"mode": mode}, timeout=5)
            refused = complete(temperature=0)
            assert refused.status_code == 503, mode
            assert refused.json()["error"] == {
                "message": "Generation is paused. Please retry after it resumes.",
                "type": "ServiceUnavailableError", "param": None, "code": 503,
            }  # fmt: skip
            requests.post(f"{url}/resume", timeout=5)
            assert complete(temperature=0).status_code == 200
        requests.post(f"{url}/pause", params={"mode": "keep"}, timeout=5)
        waiting: dict[str, requests.Response] = {}
        request = threading.Thread(target=lambda: waiting.update(answer=complete(temperature=0)))
        request.start()
        request.join(0.5)
        assert request.is_alive()  # keep: the new request waits for /resume
        requests.post(f"{url}/resume", timeout=5)
        request.join(30)
        assert waiting["answer"].status_code == 200

        sampled = complete(temperature=1.0, n=3, logprobs=1).json()["choices"]
        assert [c["index"] for c in sampled] == list(range(6))
        assert all(len(c["logprobs"]["token_logprobs"]) == len(c["logprobs"]["tokens"]) <= 4 for c in sampled)
        assert complete(n=0).json()["error"]["message"] == "n must be a positive integer"

        caplog.set_level(logging.INFO, logger="wt_callbacks.receiver")
        client = HTTPVLLMWeightSyncClient(url, timeout=30)
        trainer_model = toy_task.build_model(tokenizer, seed=0)
        engine = WeightTransferTrainerFactory.trainer_init(
            "torch_dist", {"timeout_s": 30}, LOCAL, client=client, source=ModuleSource(trainer_model)
        )
        engine.send_weights("step-3")
        engine.shutdown()
    size = sum(p.numel() * 4 for p in trainer_model.parameters()) / 1e6
    tensors = len(list(trainer_model.parameters()))
    lines = [r.getMessage() for r in caplog.records if r.name == "wt_callbacks.receiver.core"]
    assert lines == [f"weight update step-3: {tensors} tensors, {size:.1f} MB in {lines[0].rsplit(' in ', 1)[1]}"]


def test_receiver_completions_are_bounded_by_the_context_and_the_vocabulary():
    """As vLLM 0.32: 400 for max_tokens above max_model_len (128 here, the
    config's max_position_embeddings) or a prompt that leaves no room, and a
    max_tokens cut to the room a prompt leaves; 400 for token ids outside the
    vocabulary and for too many completions. Generation holds the lock a
    weight update waits for: nothing unbounded may run under it."""
    from wt_callbacks.receiver.core import MAX_COMPLETIONS_N

    with Receiver(TINY_LMS["llama_tied"]()) as served:
        url = served.start()

        def complete(prompt: list[int], **body: Any) -> requests.Response:
            body = {"prompt": prompt, "return_tokens_as_token_ids": True, "ignore_eos": True, **body}
            return requests.post(f"{url}/v1/completions", json=body, timeout=30)

        def refusal(reply: requests.Response) -> str:
            assert reply.status_code == 400, reply.text
            return reply.json()["error"]["message"]

        assert refusal(complete([1], max_tokens=129)) == (
            "max_tokens=129 cannot be greater than max_model_len=128. Please request fewer output tokens."
        )
        assert refusal(complete([1] * 128, max_tokens=1)).startswith(
            "This model's maximum context length is 128 tokens. However, your prompt contains 128 input tokens"
        )
        cut = complete([1] * 120, max_tokens=16, logprobs=1).json()["choices"][0]
        assert cut["finish_reason"] == "length" and len(cut["logprobs"]["tokens"]) == 8
        assert refusal(complete([3, 20])) == "Token id 20 is out of vocabulary (the model's has 20 tokens)"
        assert refusal(complete([[1], [-5]])) == "Token id -5 is out of vocabulary (the model's has 20 tokens)"
        too_many = MAX_COMPLETIONS_N + 1
        assert refusal(complete([1], n=too_many, temperature=1.0)) == f"n must be at most {MAX_COMPLETIONS_N}, got {too_many}."
        assert complete([1], max_tokens=2, n=MAX_COMPLETIONS_N, temperature=1.0).status_code == 200


def test_receiver_refuses_mismatched_names_before_streaming(receiver):
    """The sender learns of a wrong model from the server at once, not at its timeout."""
    client = HTTPVLLMWeightSyncClient(receiver.url, timeout=10)
    engine = WeightTransferTrainerFactory.trainer_init(
        "torch_dist", {"timeout_s": 60}, LOCAL, client=client, source=ModuleSource(torch.nn.Linear(4, 5))
    )

    start = time.monotonic()
    with pytest.raises(Exception, match=r"shape mismatch for 'weight': trainer sends \[5, 4\], the served model has \[4, 4\]"):
        engine.send_weights("wrong")
    assert time.monotonic() - start < 10
    engine.shutdown()


def test_a_round_that_leaves_a_served_parameter_out_is_refused_and_the_weights_kept():
    """DESIGN: a server that did not update every parameter it serves fails
    the round and keeps the previous weights (at finish: a round may come in
    several updates; vLLM's plugin refuses it at its one update). A tied
    lm_head, sent once as its embedding, counts; ``exclude`` of a tensor the
    server serves makes a partial round."""
    from wt_callbacks.checksums import module_checksums

    def round_into(url: str, source: WeightSource) -> None:
        client = HTTPVLLMWeightSyncClient(url, timeout=10)
        engine = WeightTransferTrainerFactory.trainer_init("torch_dist", {"timeout_s": 60}, LOCAL, client=client, source=source)
        try:
            engine.send_weights("v")
        finally:
            engine.shutdown()
            client.close()

    with Receiver(models.tiny_mlp()) as served:
        url = served.start()
        before = module_checksums(served.model)
        start = time.monotonic()
        with pytest.raises(WeightTransferError, match=(
            r"this round does not send checkpoint tensor 'layers.2.weight' \(and 1 more checkpoint tensors\), "
            r"which the served model holds: it sends 4 of its 6. Nothing was applied; the server keeps the previous weights"
        )):  # fmt: skip
            round_into(url, ModuleSource(models.TinyMLP(depth=2)))
        assert time.monotonic() - start < 10  # refused, not timed out
        assert module_checksums(served.model) == before
        assert served.core.updates_completed == 0
        round_into(url, ModuleSource(models.tiny_mlp(seed=0)))  # the refused round left nothing active
        assert module_checksums(served.model) == module_checksums(models.tiny_mlp(seed=0))

    tied = TINY_LMS["llama_tied"]
    with Receiver(tied()) as served:
        url = served.start()
        round_into(url, ModuleSource(tied(seed=0)))
        with pytest.raises(WeightTransferError, match=r"does not send checkpoint tensor 'model.norm.weight', which"):
            round_into(url, ModuleSource(tied(seed=1), exclude=["model.norm.*"]))
        assert module_checksums(served.model) == module_checksums(tied(seed=0))


def test_a_round_that_names_a_tensor_twice_is_refused_before_anything_moves(receiver):
    """By the trainer, before any call of the round; by the server, for a
    caller that posts such an update itself."""
    client = HTTPVLLMWeightSyncClient(receiver.url, timeout=10)
    weight = torch.ones(4, 4)
    engine = WeightTransferTrainerFactory.trainer_init(
        "torch_dist", {"timeout_s": 60}, LOCAL, client=client, source=_ListSource([("weight", weight), ("weight", weight)])
    )
    try:
        with pytest.raises(ValueError, match=r"the weight source's metadata\(\) lists 'weight' twice \(at 0 and 1\)"):
            engine.send_weights("twice")
        client.start_weight_update()  # not "already active": the trainer's round never began
        update = {"names": ["weight", "weight"], "dtype_names": ["float32"] * 2, "shapes": [[4, 4]] * 2,
                  "session_id": engine.session_id}  # fmt: skip
        with pytest.raises(WeightSyncHTTPError, match=r"names lists 'weight' twice \(at 0 and 1\)"):
            client.update_weights(update)
    finally:
        engine.shutdown()
    assert receiver.core.updates_completed == 0


def test_receiver_reload_weights_from_safetensors(receiver, tmp_path):
    """vLLM's reload-from-disk RPC: all or nothing, and no version change."""
    from safetensors.torch import save_file

    url = receiver.url
    new = torch.nn.Linear(4, 4)
    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in new.state_dict().items()}, tmp_path / "model.safetensors")
    reply = requests.post(
        f"{url}/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}, timeout=10
    )
    assert reply.status_code == 200 and reply.json() == {"results": [None]}
    assert torch.equal(receiver.model.weight, new.weight.detach().to(torch.bfloat16).float())
    assert requests.get(f"{url}/weight_info", timeout=5).json()["updates_completed"] == 0

    before = receiver.model.weight.detach().clone()
    save_file({"weight": torch.ones(4, 4), "bias": torch.ones(5)}, tmp_path / "model.safetensors")
    wrong = requests.post(
        f"{url}/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}, timeout=10
    )
    assert wrong.status_code == 500 and "shape mismatch for 'bias'" in wrong.json()["error"]["message"]
    assert torch.equal(receiver.model.weight, before)
    empty = requests.post(
        f"{url}/collective_rpc",
        json={"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "none")}},
        timeout=10,
    )
    assert empty.status_code == 500 and "has no *.safetensors file" in empty.json()["error"]["message"]
    # Complete over all its files, as a checkpoint split in shards; refused without one of them.
    (tmp_path / "model.safetensors").unlink()
    save_file({"weight": torch.ones(4, 4)}, tmp_path / "model-1.safetensors")
    partial = requests.post(
        f"{url}/collective_rpc", json={"method": "reload_weights", "args": [str(tmp_path)]}, timeout=10
    )
    assert partial.status_code == 500 and "does not send checkpoint tensor 'bias'" in partial.json()["error"]["message"]
    assert torch.equal(receiver.model.weight, before)
    save_file({"bias": torch.ones(4)}, tmp_path / "model-2.safetensors")
    sharded = requests.post(
        f"{url}/collective_rpc", json={"method": "reload_weights", "args": [str(tmp_path)]}, timeout=10
    )
    assert sharded.status_code == 200 and torch.equal(receiver.model.bias, torch.ones(4))
    other = requests.post(f"{url}/collective_rpc", json={"method": "sleep"}, timeout=10)
    assert other.status_code == 400 and "'sleep' is not supported" in other.json()["error"]["message"]


def test_receiver_port_in_use_is_named(receiver):
    port = int(receiver.url.rsplit(":", 1)[1])
    with pytest.raises(OSError, match=f"receiver cannot listen on 127.0.0.1:{port}"):
        Receiver(torch.nn.Linear(1, 1)).start(port=port)


def test_ray_receiver_arguments_it_cannot_use_are_refused_naming_them():
    """The class Ray hosts, called directly: a dtype it would ignore, and a
    bare payload where vLLM's LLM takes a request (or {"init_info": ...})."""
    from wt_callbacks.receiver import RayReceiver
    from wt_callbacks.transfer import WeightTransferUpdateRequest

    with pytest.raises(ValueError, match=r"dtype='bfloat16' applies to a model directory; pass the module in the dtype to serve"):
        RayReceiver(models.tiny_mlp(), dtype="bfloat16")
    served = RayReceiver(models.tiny_mlp())
    bare = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    with pytest.raises(ValueError, match=r"request must be a WeightTransferInitRequest or \{'init_info': \.\.\.\}, as vLLM's LLM takes; got a dict with keys \['master_address', "):
        served.init_weight_transfer_engine(bare)
    served.start_weight_update()
    with pytest.raises(ValueError, match=r"request must be a WeightTransferUpdateRequest or \{'update_info': \.\.\.\}, .*; got a str"):
        served.update_weights("names")
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine must be called"):  # the wrapped forms still go through
        served.update_weights(WeightTransferUpdateRequest({"names": [], "dtype_names": [], "shapes": []}))


MLP = ("--module-factory", "wt_callbacks.demos.models:tiny_mlp")


@pytest.mark.parametrize(
    "args, error",
    [
        (("--port", "-1", *MLP), "argument --port: '-1' is not a port number (0 to 65535; 0 picks a free port)"),
        (("--port", "70000", *MLP), "argument --port: '70000' is not a port number"),
        (("--dtype", "int8", *MLP), "--dtype='int8': weights are held in a floating-point dtype such as 'bfloat16'"),
        (("--module-factory", "nope.mod:fn"), "--module-factory 'nope.mod:fn': No module named 'nope'"),
        (("--module-factory", "wt_callbacks.demos.models:nope"), "--module-factory 'wt_callbacks.demos.models:nope': module 'wt_callbacks.demos.models' has no attribute 'nope'"),
        (("--backend", "bogus", *MLP), "--backend: Invalid weight transfer backend: 'bogus'. Available engines: ['torch_dist']"),
        (("--model", "/nonexistent"), "--model '/nonexistent' is not a transformers model directory: "),
        (("--host", "bogus.invalid", "--port", "0", *MLP), "receiver cannot listen on bogus.invalid:0: [Errno -2] Name or service not known; --host must be an address of this machine"),
    ],
    ids=["port -1", "port 70000", "dtype int8", "no module", "no function", "backend", "model", "host"],
)
def test_receiver_cli_mistakes_are_usage_errors_naming_the_flag(args, error, capsys):
    from wt_callbacks.receiver import main

    with pytest.raises(SystemExit) as exit:
        main(args)
    assert exit.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"python -m wt_callbacks.receiver: error: {error}"), last


def test_receiver_cli_port_in_use_says_to_choose_another(receiver, capsys):
    from wt_callbacks.receiver import main

    port = receiver.url.rsplit(":", 1)[1]
    with pytest.raises(SystemExit):
        main(["--port", port, *MLP])
    assert capsys.readouterr().err.rstrip().endswith("Address already in use; choose another --port")


@pytest.mark.parametrize("packed", [True, False])
def test_static_trainer_send_weights_older_call_style(receiver, packed):
    """vLLM's older trainer API: the caller owns the group and the server calls."""
    from wt_callbacks.checksums import module_checksums
    from wt_callbacks.transfer.backends.torch_dist import TransferGroup, open_store, update_info_for

    model = torch.nn.Linear(4, 4)
    client = HTTPVLLMWeightSyncClient(receiver.url, timeout=10)
    store = open_store("127.0.0.1", 0, 2, is_master=True, timeout_s=10)
    init = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
            "packed": packed, "packed_buffer_size_bytes": 16, "timeout_s": 10}  # fmt: skip
    joining = threading.Thread(target=client.init_weight_transfer_engine, args=(init,))
    joining.start()
    group = TransferGroup.connect(
        store, master_address="127.0.0.1", rank=0, world_size=2, timeout_s=10, transport="gloo", device=torch.device("cpu")
    )
    joining.join(10)
    client.start_weight_update()
    receiving = threading.Thread(target=client.update_weights, args=(update_info_for(ModuleSource(model).metadata()),))
    receiving.start()
    TorchDistWeightTransferEngine.trainer_send_weights(
        model.named_parameters(), {"group": group, "packed": packed, "packed_buffer_size_bytes": 16}
    )
    receiving.join(10)
    client.finish_weight_update("static")
    engine = receiver.core.engine
    assert engine.last_receive is not None and engine.last_receive.tensors == 2
    # What a round's finish reports is that round's receive: a round that
    # received nothing reports nothing, not the round before it.
    client.start_weight_update()
    assert engine.last_receive is None
    client.finish_weight_update()
    group.destroy()
    assert module_checksums(receiver.model) == module_checksums(model)
    with pytest.raises(ValueError, match="trainer_args: missing required key 'group'"):
        TorchDistWeightTransferEngine.trainer_send_weights(iter([]), {})


def test_zero_size_parameters_last_in_the_plan():
    """A trailing zero-byte tensor forms a chunk of its own on the receiver's
    plan; neither side may broadcast it, or the round waits for its timeout."""

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        module = torch.nn.Linear(8, 8)
        module.empty = torch.nn.Parameter(torch.empty(0, 8))
        return module

    from wt_callbacks.checksums import module_checksums

    trainer_model = build(0)
    # 20-byte buffers: weight and bias each close a chunk, the empty tensor is alone.
    assert plan_chunks([256, 32, 0], 20)[-1] == range(2, 3)
    with Receiver(build(1)) as receiver:
        client = HTTPVLLMWeightSyncClient(receiver.start(), timeout=10)
        engine = WeightTransferTrainerFactory.trainer_init(
            "torch_dist", {"timeout_s": 10, "packed_buffer_size_bytes": 20}, LOCAL, client=client,
            source=ModuleSource(trainer_model),
        )  # fmt: skip
        engine.send_weights("with-empty")
        engine.shutdown()
        assert module_checksums(receiver.model) == module_checksums(trainer_model)


def test_uncast_iteration_leaves_whole_parameters_to_the_transport():
    """Engines iterate ``iter_uncast()``: whole parameters come in their own
    dtype (the packing casts them), the checkpoint format and exclude apply
    as in plain iteration (every tiny transformers family), and a ``ModuleSource`` subclass with its own
    ``__iter__`` is sent as it iterates, not bypassed."""

    class Doubled(ModuleSource):
        def __iter__(self):
            for name, tensor in super().__iter__():
                yield name, tensor * 2

    model = torch.nn.Linear(2, 2)
    sent = dict(Doubled(model, dtype=torch.bfloat16).iter_uncast())
    assert all(t.dtype == torch.bfloat16 for t in sent.values())
    assert torch.equal(sent["weight"], (model.weight.detach() * 2).to(torch.bfloat16))
    for family, build in sorted(TINY_LMS.items()):
        source = ModuleSource(build(seed=0), dtype=torch.bfloat16, exclude=["lm_head.*"])
        cast, uncast = list(source), list(source.iter_uncast())
        assert [n for n, _ in uncast] == [n for n, _ in cast] == [m.name for m in source.metadata()], family
        assert {t.dtype for _, t in uncast} == {torch.float32}, family
        assert all(torch.equal(u.to(torch.bfloat16), c) for (_, u), (_, c) in zip(uncast, cast)), family
