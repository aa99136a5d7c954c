"""SyncConfig: parsing from every hparams container, and every validation message."""

import argparse
import datetime

import pytest
import torch
from omegaconf import OmegaConf

from wt_callbacks.config import SyncConfig

URL = "http://127.0.0.1:8000"
SECTION = {
    "backend": "torch_dist",
    "every_n_train_steps": 10,
    "servers": [URL],
    "module": "model",
    "dtype": "bfloat16",
    "pause": "wait",
    "init_info": {"master_address": "127.0.0.1", "master_port": 29600},
    "config": {"packed": True, "packed_buffer_size_bytes": 1024, "packed_num_buffers": 2},
    "timeout_s": 30,
    "on_error": "warn",
}


class AttributeDict(dict):
    """Stands in for Lightning's AttributeDict: a dict subclass with attribute access."""

    def __getattr__(self, key):
        return self[key]


def _expected(config: SyncConfig) -> None:
    assert config.every_n_train_steps == 10
    assert config.servers == [URL]
    assert config.module == "model"
    assert config.dtype == "bfloat16"
    assert config.backend_config()["dtype"] == "bfloat16"
    assert config.pause == "wait"
    assert config.on_error == "warn"
    assert config.init_info == {"master_address": "127.0.0.1", "master_port": 29600}
    assert config.trigger == ("every_n_train_steps", 10)


@pytest.mark.parametrize(
    "hparams",
    [
        pytest.param(SECTION, id="dict-section"),
        pytest.param({"lr": 1e-3, "weight_sync": SECTION}, id="dict-container"),
        pytest.param(argparse.Namespace(lr=1e-3, weight_sync=SECTION), id="namespace-container"),
        pytest.param(argparse.Namespace(**SECTION), id="namespace-section"),
        pytest.param(argparse.Namespace(weight_sync=argparse.Namespace(**SECTION)), id="namespace-nested"),
        pytest.param(AttributeDict(lr=1e-3, weight_sync=SECTION), id="attributedict"),
        pytest.param(OmegaConf.create({"lr": 1e-3, "weight_sync": SECTION}), id="omegaconf-container"),
        pytest.param(OmegaConf.create(SECTION), id="omegaconf-section"),
        pytest.param({"weight_sync": OmegaConf.create(SECTION)}, id="dict-of-omegaconf"),
    ],
)
def test_from_hparams_containers(hparams):
    _expected(SyncConfig.from_hparams(hparams))


def test_omegaconf_interpolation_is_resolved():
    hparams = OmegaConf.create({"url": URL, "weight_sync": {"servers": ["${url}"]}})
    assert SyncConfig.from_hparams(hparams).servers == [URL]


def test_custom_key_and_overrides_win_none_ignored():
    config = SyncConfig.from_hparams(
        {"sync": SECTION}, key="sync", every_n_train_steps=None, every_n_epochs=None, on_error="raise", pause=None
    )
    assert config.on_error == "raise"
    assert config.pause == "wait"
    # An override of the cadence or the destination replaces the section's choice.
    switched = SyncConfig.from_hparams(SECTION, every_n_epochs=2, ray_actors=["vllm-0"])
    assert switched.trigger == ("every_n_epochs", 2) and switched.every_n_train_steps is None
    assert switched.ray_actors == ["vllm-0"] and switched.servers == []
    # Within one source the keys still clash.
    with pytest.raises(ValueError, match="every_n_train_steps and every_n_epochs are mutually exclusive"):
        SyncConfig.from_hparams(None, servers=[URL], every_n_train_steps=2, every_n_epochs=2)


def test_container_without_section_takes_overrides_only():
    config = SyncConfig.from_hparams({"lr": 1e-3, "hidden": 8}, servers=[URL])
    assert config.servers == [URL]
    assert config.backend == "torch_dist"
    # Keys of the section beside other keys: refused, not guessed either way
    # (a training config holding a dtype, or a section with a stray key).
    for mixed in ({"lr": 1e-3, "dtype": "bfloat16"}, {"every_n_train_steps": 50, "module": "model", "notes": "x"}):
        with pytest.raises(ValueError, match=r"^weight_sync: these hyperparameters have no 'weight_sync' key, and they mix"):
            SyncConfig.from_hparams(mixed, servers=[URL])
    # The section itself with a typo is still read as the section, to say so.
    with pytest.raises(ValueError, match=r"unknown key 'evry_n_train_steps'; did you mean 'every_n_train_steps'\?"):
        SyncConfig.from_hparams({"servers": [URL], "evry_n_train_steps": 2})
    assert SyncConfig.from_hparams(None, servers=[URL]).servers == [URL]


def test_defaults():
    config = SyncConfig(servers=[URL])
    assert config.trigger == ("every_n_train_steps", 1)
    assert config.sync_on_fit_start and config.sync_on_train_end
    assert config.pause_mode == "keep"
    assert config.timeout_s == 300
    assert config.on_error == "raise"
    assert config.backend_config()["dtype"] is None
    assert config.init_info_for(rank=1) == {"rank": 1}
    assert SyncConfig(servers=[URL], pause="none").pause_mode is None


def test_time_interval_accepts_timedelta_and_seconds():
    assert SyncConfig(servers=[URL], train_time_interval=datetime.timedelta(minutes=2)).trigger == (
        "train_time_interval",
        120.0,
    )
    assert SyncConfig(servers=[URL], train_time_interval=1.5).train_time_interval == 1.5


def test_torch_dtype_override_is_stored_by_name():
    assert SyncConfig.from_hparams(SECTION, dtype=torch.float16).dtype == "float16"


def test_top_level_dtype_and_timeout_fill_the_backend_config_unless_set_there():
    config = SyncConfig(servers=[URL], dtype="bfloat16", timeout_s=30, config={"packed": False})
    assert config.backend_config() == {"packed": False, "dtype": "bfloat16", "timeout_s": 30}
    nested = SyncConfig(servers=[URL], dtype="bfloat16", timeout_s=30, config={"dtype": "float16", "timeout_s": 5})
    assert nested.backend_config() == {"dtype": "float16", "timeout_s": 5}


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"every_n_train_steps": 2, "every_n_epochs": 1}, r"every_n_train_steps and every_n_epochs are mutually exclusive"),
        ({"every_n_epochs": 1, "train_time_interval": 5}, r"every_n_epochs and train_time_interval are mutually exclusive"),
        ({"every_n_train_steps": -1}, r"every_n_train_steps=-1 must be a positive integer, or 0 for no periodic syncs"),
        ({"every_n_epochs": -1}, r"every_n_epochs=-1 must be a positive integer, or 0 for no periodic syncs"),
        ({"train_time_interval": 0}, r"train_time_interval=0 must be a positive number of seconds"),
        ({"train_time_interval": float("nan")}, r"train_time_interval=nan must be a positive number of seconds"),
        ({"timeout_s": float("nan")}, r"timeout_s=nan must be a positive number of seconds"),
        ({"timeout_s": float("inf")}, r"timeout_s=inf must be a positive number of seconds"),
        ({"train_time_interval": "10m"}, r"train_time_interval='10m' must be a positive number of seconds"),
        ({"timeout_s": -5}, r"timeout_s=-5 must be a positive number of seconds"),
        ({"timeout_s": 1e15}, r"timeout_s=1000000000000000.0 must be a positive number of seconds \(<= 1e\+09\)"),
        ({"every_n_train_steps": "10"}, r"key 'every_n_train_steps' must be of type int \| None, got str"),
        ({"backend": "torch_dst"}, r"backend='torch_dst' is not one of \('ipc', 'nccl', 'torch_dist'\); did you mean 'torch_dist'\?"),
        ({"servers": []}, r"no servers to sync to: set servers: \[http://host:port, \.\.\.\] .* or ray_actors"),
        ({"ray_actors": ["vllm"]}, r"servers and ray_actors are mutually exclusive"),
        ({"servers": [URL, ""]}, r"servers must be a list of non-empty strings, got entries \[''\]"),
        ({"include": ["*.weight", 3]}, r"include must be a list of non-empty strings, got entries \[3\]"),
        ({"dtype": "bfloat17"}, r"dtype='bfloat17' is not a torch dtype name; did you mean 'bfloat16'\?"),
        ({"dtype": "int8"}, r"dtype='int8': the wire dtype must be a floating-point dtype"),
        ({"pause": "kep"}, r"pause='kep' is not one of \('abort', 'wait', 'keep', 'none'\); did you mean 'keep'\?"),
        ({"on_error": "ignore"}, r"on_error='ignore' is not one of \('raise', 'warn'\)"),
        ({"server": [URL]}, r"unknown key 'server'; did you mean 'servers'\?"),
        ({"every_n_train_step": 3}, r"unknown key 'every_n_train_step'; did you mean 'every_n_train_steps'\?"),
        ({"config": {"packd": True}}, r"config for TorchDist\w+: unknown key 'packd'; did you mean 'packed'\?"),
        ({"config": {"packed_num_buffers": 0}}, r"config for TorchDist\w+: packed_num_buffers=0 must be a positive integer"),
        ({"config": {"all_or_nothing": "false"}}, r"config for TorchDist\w+: key 'all_or_nothing' must be of type <class 'bool'>, got str 'false'"),
        ({"config": {"transport": "mpi"}}, r"config for TorchDist\w+: transport='mpi' is not one of \('auto', 'gloo', 'nccl', 'shm'\)"),
        ({"init_info": {"master_prot": 1}}, r"init_info for TorchDist\w+: unknown key 'master_prot'; did you mean 'master_port'\?"),
        ({"init_info": {"master_port": 70000}}, r"init_info for TorchDist\w+: master_port must be in 0\.\.65535, got 70000"),
        ({"init_info": {"rank": 1}}, r"init_info: remove 'rank'; each trainer process sets its own rank"),
        ({"send": "asynch"}, r"send='asynch' is not one of \('blocking', 'async'\); did you mean 'async'\?"),
        ({"commit": "stage"}, r"commit='stage' is not one of \('inline', 'staged', 'prepared'\); did you mean 'staged'\?"),
        ({"commit": "prepared", "backend": "nccl"}, r"commit: prepared needs backend: torch_dist, not 'nccl': .*; set commit: inline"),
        ({"async_overflow": "drop"}, r"async_overflow='drop' is not one of \('wait', 'skip'\)"),
        ({"send": "async", "backend": "nccl"}, r"send: async needs backend: torch_dist, not 'nccl': vLLM's own nccl/ipc transfer runs a NCCL communicator, which must not run beside the training's own collectives; set send: blocking"),
        ({"commit": "staged", "backend": "ipc"}, r"commit: staged needs backend: torch_dist, not 'ipc': .*; set commit: inline"),
        ({"send": "async", "config": {"transport": "nccl"}}, r"send: async cannot use config.transport: nccl: a NCCL broadcast on a background thread"),
        ({"send": "async", "verify_every_n_syncs": 5}, r"verify_every_n_syncs: under send: async .* call sync_now\(verify=True\)"),
        ({"async_overflow": "skip"}, r"async_overflow: skip applies to send: async, and send is 'blocking'; set send: async"),
        ({"commit": "prepared", "staging_nice": 20}, r"staging_nice=20 must be an integer niceness from 0 to 19"),
        ({"commit": "staged", "staging_nice": -1}, r"staging_nice=-1 must be an integer niceness from 0 to 19"),
        ({"commit": "staged", "staging_nice": "low"}, r"key 'staging_nice' must be of type int \| None, got str 'low'"),
        ({"staging_nice": 10}, r"staging_nice sets the niceness servers stage a round at, and commit: inline rounds are not staged"),
    ],
)
def test_validation_messages_name_the_key(bad, match):
    with pytest.raises(ValueError, match=r"^weight_sync: " + match):
        SyncConfig.from_hparams({"weight_sync": {"servers": [URL], **bad}})


def test_staging_niceness_defaults_to_background_for_rounds_the_loop_does_not_wait_for():
    """Left out, ``staging_nice`` is 10 for a staged round the training loop
    does not wait for (``send: async``) and 0 for one it waits for; set, it
    is what every round asks for."""
    def niceness(awaited=False, **keys):
        return SyncConfig(servers=[URL], **keys).staging_niceness(awaited=awaited)

    assert niceness(commit="prepared", send="async") == niceness(commit="staged", send="async") == 10
    assert niceness(commit="prepared", send="async", awaited=True) == 0
    assert niceness(send="async") == niceness() == 0
    assert niceness(commit="staged", send="async", staging_nice=0) == 0
    assert niceness(commit="staged", staging_nice=19, awaited=True) == 19


def test_unsupported_container():
    with pytest.raises(ValueError, match=r"hparams must be a dict, an argparse.Namespace, an OmegaConf DictConfig, a YAML file path or a JSON object string, got list"):
        SyncConfig.from_hparams([SECTION])


def test_yaml_path_and_json_string(tmp_path):
    import json

    import yaml

    (tmp_path / "ws.yaml").write_text(yaml.safe_dump({"weight_sync": SECTION}))
    _expected(SyncConfig.from_hparams(str(tmp_path / "ws.yaml")))
    _expected(SyncConfig.from_hparams(tmp_path / "ws.yaml"))
    _expected(SyncConfig.from_hparams(json.dumps(SECTION)))  # e.g. --weight_sync '{...}' on a command line
    with pytest.raises(ValueError, match=r"^hparams: no such YAML file: .*missing.yaml"):
        SyncConfig.from_hparams(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match=r"^hparams: not a valid JSON object"):
        SyncConfig.from_hparams("{servers: [x]}")


def test_direct_construction_validates_too():
    with pytest.raises(ValueError, match=r"^every_n_epochs=-2 must be a positive integer"):
        SyncConfig(servers=[URL], every_n_epochs=-2)


@pytest.mark.parametrize("key", ["every_n_train_steps", "every_n_epochs"])
def test_zero_turns_periodic_syncs_off(key):
    """As in ModelCheckpoint: only the syncs at fit start and train end and
    ``sync_now`` run (tests/test_weight_sync.py drives such a config)."""
    config = SyncConfig(servers=[URL], **{key: 0})
    assert config.trigger == (key, 0)


@pytest.mark.parametrize(
    "adapter",
    [
        ("lightning", "wt_callbacks.integrations.lightning", "WeightSyncCallback"),
        ("transformers", "wt_callbacks.integrations.transformers", "WeightSyncTrainerCallback"),
    ],
    ids=lambda a: a[0],
)
def test_adapter_keyword_arguments_are_the_sync_config_fields(adapter):
    """The callbacks spell the section's keys out as typed keywords (LightningCLI
    reads the signature): exactly SyncConfig's fields, in order, each
    defaulting to None ("not given", so the section's value applies)."""
    import dataclasses
    import importlib
    import inspect

    framework, module, name = adapter
    pytest.importorskip(framework)
    parameters = inspect.signature(getattr(importlib.import_module(module), name).__init__).parameters
    fields = [f.name for f in dataclasses.fields(SyncConfig)]
    overrides = [p for p in parameters.values() if p.name in fields]
    assert [p.name for p in overrides] == fields
    assert all(p.default is None and p.kind is inspect.Parameter.KEYWORD_ONLY for p in overrides)
    assert set(parameters) - set(fields) <= {"self", "trainer", "hparams", "hparams_key", "client"}


def test_lora_keys():
    assert SyncConfig(servers=[URL]).lora is None  # a PEFT model merges (the module decides, at setup)
    adapter = SyncConfig(servers=[URL], lora="adapter", lora_name="policy")
    assert (adapter.lora, adapter.lora_name) == ("adapter", "policy")
    for keys, message in (
        ({"lora": "merged"}, r"lora='merged' is not one of \('merge', 'adapter'\); did you mean 'merge'\?"),
        ({"lora": "adapter"}, r"lora: adapter needs lora_name: the model name requests give"),
        ({"lora_name": "policy"}, r"lora_name names the adapter lora: adapter serves; set lora: adapter or remove lora_name"),
        ({"lora": "adapter", "lora_name": "../etc"}, r"lora_name='../etc' must be 1-128 characters of letters, digits"),
        ({"lora": "adapter", "lora_name": "p", "exclude": ["*.bias"]}, r"lora: adapter sends the adapter whole: remove them"),
        ({"lora": "adapter", "lora_name": "p", "commit": "staged"}, r"commit: staged stages base weights; .* set commit: inline"),
        ({"lora": "adapter", "lora_name": "p", "commit": "prepared"}, r"commit: prepared stages base weights; .* set commit: inline"),
    ):
        with pytest.raises(ValueError, match=message):
            SyncConfig(servers=[URL], **keys)
    with pytest.raises(ValueError, match=r"lora: adapter has the servers load each version over HTTP .* not ray_actors"):
        SyncConfig(ray_actors=["vllm-0"], lora="adapter", lora_name="policy")
    # send_frozen: once is the default for a merged PEFT model, and where asked for, on torch_dist only.
    assert SyncConfig(servers=[URL]).sends_frozen_once(peft_merge=True)
    assert not SyncConfig(servers=[URL]).sends_frozen_once(peft_merge=False)
    assert not SyncConfig(servers=[URL], send_frozen="every_round").sends_frozen_once(peft_merge=True)
    assert SyncConfig(servers=[URL], send_frozen="once").sends_frozen_once(peft_merge=False)
    for keys, message in (
        ({"send_frozen": "always"}, r"send_frozen='always' is not one of \('once', 'every_round'\)"),
        ({"send_frozen": "once", "lora": "adapter", "lora_name": "p"}, r"send_frozen: once applies to model weights; lora: adapter"),
        ({"send_frozen": "once", "backend": "nccl"}, r"send_frozen: once needs backend: torch_dist, not 'nccl'.*set send_frozen: every_round"),
    ):
        with pytest.raises(ValueError, match=message):
            SyncConfig(servers=[URL], **keys)
    # A learning rate beside a section key is no typo of "lora": the container is refused as mixed.
    with pytest.raises(ValueError, match=r"^weight_sync: these hyperparameters have no 'weight_sync' key, and they mix"):
        SyncConfig.from_hparams({"lr": 1e-3, "dtype": "bfloat16"}, servers=[URL])
