"""PEFT (LoRA) models as the sources send them: merged into the base checkpoint, or the adapter alone.

Merge mode must send, under every sharding scheme, bitwise what the same
PEFT model sends unsharded, which is bitwise PEFT's own ``merge_and_unload``
in float32 (checked here unsharded for every layer kind: Linear, GPT-2's
Conv1D, embeddings, DoRA, rsLoRA with per-module ranks, packed MoE experts,
``lora_bias``, ``modules_to_save``), under the base checkpoint's names, and
never change the trainer's parameters. Under FSDP2 each rank merges the rows
it holds before the gather (a bf16 wire gathers bf16). Adapter mode sends
``A`` and ``B`` as PEFT saves them. What a mode cannot send fails at
construction, naming the other mode.

FSDP2 runs on two gloo ranks as Lightning's ``ModelParallelStrategy`` shards
(``fully_shard`` per decoder layer, then the root); FSDP1 with PEFT's own
``fsdp_auto_wrap_policy`` (every factor a unit of its own); DeepSpeed ZeRO-3
with every parameter partitioned.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.lora import trained
from tests.test_sharded_sources import deepspeed_engine
from wt_callbacks.demos import tiny_lms
from wt_callbacks.demos.multiprocess import free_port, leave_group_together
from wt_callbacks.lora.adapter import AdapterSource
from wt_callbacks.transfer import ModuleSource

peft = pytest.importorskip("peft")
TIMEOUT = datetime.timedelta(seconds=120)


CASES = {
    "all-linear": ("llama_untied", dict(r=4, lora_alpha=8, target_modules="all-linear")),
    "rslora-patterns": (
        "llama_untied",
        dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"], rank_pattern={"q_proj": 2}, alpha_pattern={"v_proj": 32}),
    ),
    "dora-modules-to-save": ("llama_untied", dict(r=4, target_modules=["q_proj", "v_proj"], use_dora=True, modules_to_save=["lm_head"])),
    "embeddings-untied": ("llama_untied", dict(r=4, target_modules=["q_proj", "embed_tokens", "lm_head"])),
    "gpt2-conv1d": ("gpt2", dict(r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)),
    "gpt2-conv1d-dora": ("gpt2", dict(r=4, target_modules=["c_attn"], fan_in_fan_out=True, use_dora=True)),
    "moe-experts": ("qwen3_moe", dict(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
    "lora-bias": ("qwen2_tied", dict(r=4, target_modules=["q_proj"], lora_bias=True)),
    "modules-to-save": ("llama_untied", dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])),
    "bias-all": ("qwen2_tied", dict(r=4, target_modules=["q_proj", "v_proj"], bias="all")),
}


def peft_case(case: str, seed: int = 0) -> torch.nn.Module:
    family, config = CASES[case]
    return trained(tiny_lms.TINY_LMS[family](seed), peft.LoraConfig(**config))


@pytest.mark.parametrize("case", list(CASES))
def test_merge_sends_peft_merge_and_unload_bitwise(case):
    model = peft_case(case)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for dtype in (None, torch.bfloat16):
        source = ModuleSource(model, dtype=dtype)
        sent = list(source)
        expected = dict(ModuleSource(copy.deepcopy(model).merge_and_unload(), dtype=dtype))
        assert [n for n, _ in sent] == [m.name for m in source.metadata()] == list(expected)
        for name, tensor in sent:
            assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), (case, name)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "the trainer's model changed"


def test_adapter_sends_what_peft_saves(tmp_path):
    model = peft_case("embeddings-untied")
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter_model.safetensors")
    sent = dict(AdapterSource(model))
    # PEFT also saves the embedding's base weight (save_embedding_layers); servers ignore it.
    assert set(sent) == {n for n in saved if "lora_" in n}
    assert all(torch.equal(t, saved[n]) for n, t in sent.items())
    config = AdapterSource(model).adapter_config()
    assert config["rank_pattern"]["model\\.layers\\.0\\.self_attn\\.q_proj"] == 4 and config["lora_alpha"] == 8


def test_what_a_mode_cannot_send_is_refused_naming_the_other():
    tied = trained(tiny_lms.llama_tied(0), peft.LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]))
    with pytest.raises(ValueError, match=r"lora: merge: a LoRA on base_model\.model\.model\.embed_tokens, an embedding tied .* Use lora: adapter"):
        ModuleSource(tied)
    assert len(list(AdapterSource(tied))) == 6  # A and B of two q_proj and of the embedding
    for case, message in (
        ("dora-modules-to-save", r"lora: adapter: .*uses DoRA, which vLLM does not serve as an adapter. Use lora: merge"),
        ("gpt2-conv1d", r"lora: adapter: .*c_attn is a fan-in-fan-out layer \(Conv1D, as GPT-2's Conv1D\): vLLM serves no LoRA on such models. Use lora: merge"),
        ("lora-bias", r"lora: adapter: .*lora_bias=True, which vLLM does not serve. Use lora: merge"),
        ("bias-all", r"lora: adapter: bias='all' trains the base model's biases, .* Use lora: merge"),
        ("modules-to-save", r"lora: adapter: modules_to_save holds base_model\.model\.lm_head, and vLLM serves only \['classifier', 'score'\].* Use lora: merge"),
    ):
        with pytest.raises(ValueError, match=message):
            AdapterSource(peft_case(case))
    two = peft_case("all-linear")
    two.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    two.base_model.set_adapter(["default", "other"])
    with pytest.raises(ValueError, match=r"lora: adapter: several adapters are active \(\['default', 'other'\]\).* use lora: merge"):
        AdapterSource(two)
    with pytest.raises(ValueError, match=r"lora: merge: module=None \(LlamaForCausalLM\) holds no PEFT model"):
        ModuleSource(tiny_lms.llama_untied(0), lora="merge")


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_base_is_refused_for_merge_and_sent_as_an_adapter(tmp_path, bits):
    """QLoRA: bitsandbytes' 8- and 4-bit bases (real layers, on the CPU)."""
    pytest.importorskip("bitsandbytes")
    import transformers
    from safetensors.torch import load_file

    quantization = {"load_in_8bit": True} if bits == 8 else {"load_in_4bit": True, "bnb_4bit_compute_dtype": torch.float32}
    base = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_lms.save_pretrained("llama_untied", tmp_path / "base", seed=0), device_map="cpu",
        quantization_config=transformers.BitsAndBytesConfig(**quantization),
    )  # fmt: skip
    model = trained(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match=rf"lora: merge: .*q_proj has a quantized base \(Linear{bits}\w*\).* Use lora: adapter"):
        ModuleSource(model)
    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    sent = dict(AdapterSource(model))
    assert set(sent) == set(saved) and all(torch.equal(t, saved[n]) for n, t in sent.items())


def test_through_ddp_and_a_lightning_module_holding_the_peft_model():
    """Found through DDP and below the module given (a LightningModule holding
    the PEFT model at ``.model``): the same tensors, the same names."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        holder = torch.nn.Module()
        holder.model = peft_case("all-linear")
        expected = dict(ModuleSource(holder.model))
        ddp = torch.nn.parallel.DistributedDataParallel(holder)
        for source, prefix in ((ModuleSource(ddp, submodule="model"), ""), (ModuleSource(ddp), "model.")):
            sent = dict(source)
            assert list(sent) == [prefix + n for n in expected]
            assert all(torch.equal(sent[prefix + n], t) for n, t in expected.items())
        adapter = dict(AdapterSource(holder.model))
        for source in (AdapterSource(ddp, submodule="model"), AdapterSource(ddp)):  # names as PEFT saves them either way
            sent = dict(source)
            assert list(sent) == list(adapter) and all(torch.equal(sent[n], t) for n, t in adapter.items())
    finally:
        dist.destroy_process_group()


def test_only_active_adapters_count_and_merged_ones_are_not_added_twice():
    model = peft_case("all-linear")
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    source = ModuleSource(model)
    expected = dict(ModuleSource(copy.deepcopy(model).merge_and_unload()))  # merges the active one only
    assert all(torch.equal(t, expected[n]) for n, t in source)
    model.merge_adapter()  # in place, as TRL does around its own sync: the weights hold the delta already
    assert all(torch.equal(t, expected[n]) for n, t in source)
    model.unmerge_adapter()
    with model.disable_adapter():
        base = dict(ModuleSource(copy.deepcopy(model).get_base_model()))
        assert all(torch.allclose(t, base[n], atol=1e-6) for n, t in source)


def test_adapter_mode_sends_the_active_one_of_several_adapters():
    model = peft_case("all-linear")
    model.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=8, target_modules=["q_proj"]))
    source = AdapterSource(model)
    for active, rank in (("default", 4), ("other", 2)):
        model.set_adapter(active)  # the source follows: its plan is keyed on the active adapters
        expected = peft.get_peft_model_state_dict(model, adapter_name=active)
        sent = dict(source)
        assert set(sent) == set(expected) and all(torch.equal(t, expected[n]) for n, t in sent.items()), active
        assert source.adapter_config()["r"] == rank


# What a round may leave as the servers hold it (send_frozen: once)
# --------------------------------------------------------------------------- #


def _layer(names: frozenset[str], layer: str) -> set[str]:
    """The kept names of decoder layer ``layer``, shortened to what follows it."""
    return {n.removeprefix(layer) for n in names if n.startswith(layer)}


FROZEN = {
    # Standalone modules (embeddings, norms, the output head) are kept on their own.
    "all-linear": ({"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}, {"input_layernorm.weight", "post_attention_layernorm.weight"}),
    # k_proj and o_proj are frozen but share self_attn with a LoRA'd q_proj (one fused qkv_proj in vLLM); the MLP is whole.
    "dora-modules-to-save": ({"model.embed_tokens.weight", "model.norm.weight"}, {"input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}),
    # The router shares mlp with LoRA'd experts (one fused MoE layer); Qwen3's q_norm and k_norm stand alone.
    "moe-experts": ({"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}, {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"}),
    # bias="all" trains every bias: k_proj's keeps self_attn whole; Qwen2's MLP has none.
    "bias-all": ({"model.embed_tokens.weight", "model.norm.weight"}, {"input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}),
    "gpt2-conv1d": ({"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"}, {"ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias"}),
}


@pytest.mark.parametrize("case", list(FROZEN))
def test_frozen_tensors_are_kept_in_whole_serving_units(case):
    model = peft_case(case)
    source = ModuleSource(model)
    frozen = source.frozen_names()
    top, per_layer = FROZEN[case]
    layer = "transformer.h.0." if case.startswith("gpt2") else "model.layers.0."
    assert {n for n in frozen if ".layers." not in n and ".h." not in n} == top, case
    assert _layer(frozen, layer) == per_layer, case
    # Kept names leave the pass, and only them: what is sent is what a full pass sends of the rest.
    full = dict(source)
    source.keep(frozen)
    try:
        assert [m.name for m in source.kept_metadata()] == [n for n in full if n in frozen]
        sent = list(source)
        assert [n for n, _ in sent] == [m.name for m in source.metadata()] == [n for n in full if n not in frozen]
        assert all(torch.equal(t, full[n]) for n, t in sent)
    finally:
        source.keep(())
    assert [n for n, _ in source] == list(full)


def test_a_frozen_tensor_that_trains_again_or_a_tied_output_head_follows_requires_grad():
    model = peft_case("all-linear")
    model.base_model.model.model.norm.weight.requires_grad_(True)  # unfrozen by the trainer's code
    assert "model.norm.weight" not in ModuleSource(model).frozen_names()
    # merge_adapter (as TRL does around its own sync) changes the targeted bases in place: never kept.
    before = ModuleSource(model).frozen_names()
    model.merge_adapter()
    try:
        assert ModuleSource(model).frozen_names() == before
    finally:
        model.unmerge_adapter()
    # A LayerNorm whose bias trains (bias="all" on GPT-2) goes whole: its frozen weight too.
    gpt2 = peft_case("gpt2-conv1d")
    gpt2.base_model.model.transformer.ln_f.bias.requires_grad_(True)
    assert "transformer.ln_f.weight" not in ModuleSource(gpt2).frozen_names()
    # A model with no adapter frozen by hand: the same rule, on its own parameters.
    plain = tiny_lms.TINY_LMS["llama_untied"](0)
    for name, param in plain.named_parameters():
        param.requires_grad_(not name.startswith("model.embed_tokens"))
    assert ModuleSource(plain).frozen_names() == {"model.embed_tokens.weight"}


# --------------------------------------------------------------------------- #
# --------------------------------------------------------------------------- #
# Sharded: two gloo ranks
# --------------------------------------------------------------------------- #


SHARDED_CASES = ("all-linear", "dora-modules-to-save", "gpt2-conv1d", "moe-experts")


def assert_sends_like(sharded: torch.nn.Module, plain: torch.nn.Module, what: str, *, atol: float = 0.0) -> None:
    """The sharded PEFT model sends, merged and as an adapter, what the
    unsharded one sends (rank 0 iterates; rank 1 only joins the gathers);
    merged, it keeps the same frozen tensors, and a pass leaving them out
    gathers the rest alike."""
    for build, keep in ((ModuleSource, False), (ModuleSource, True), (AdapterSource, False)):
        for dtype in (None, torch.bfloat16):
            if build is AdapterSource and ("dora" in what or "gpt2" in what or "bias" in what):  # merge mode only
                continue
            source = build(sharded, dtype=dtype)
            expected = build(plain, dtype=dtype)
            if keep:
                frozen = expected.frozen_names()
                assert frozen and source.frozen_names() == frozen, what
                source.keep(frozen)
                expected.keep(frozen)
                assert {m.name: m for m in source.kept_metadata()} == {m.name: m for m in expected.kept_metadata()}, what
            # FSDP1 sends in unit order.
            assert {m.name: m for m in source.metadata()} == {m.name: m for m in expected.metadata()}, what
            if dist.get_rank() != 0:
                assert list(source.gather_only()), what
                continue
            reference = dict(expected)
            for name, tensor in source:
                want = reference[name]
                close = torch.equal(tensor, want) if not atol else torch.allclose(tensor.float(), want.float(), atol=atol)
                assert tensor.dtype == want.dtype and close, (what, build.__name__, dtype, name)


def _local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: getattr(p, "_local_tensor", p).detach().clone() for n, p in model.named_parameters()}


def _fsdp_rank(rank: int, port: int, out_dir: str) -> None:
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=TIMEOUT)
    out: dict = {}
    try:
        mesh = init_device_mesh("cpu", (2,))
        for case in SHARDED_CASES:
            model = peft_case(case)
            for layer in model.base_model.model.modules():
                if type(layer).__name__.endswith("DecoderLayer") or type(layer).__name__ == "GPT2Block":
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            before = _local_state(model)
            assert ModuleSource(model).scheme == "fsdp2"
            assert_sends_like(model, peft_case(case), f"fsdp2 {case}")
            assert all(torch.equal(p, before[n]) for n, p in _local_state(model).items()), f"fsdp2 {case} changed the model"
        # Embedding LoRA: the per-shard product of transposed factors rounds differently from the whole one.
        sharded = peft_case("embeddings-untied")
        fully_shard(sharded, mesh=mesh)
        assert_sends_like(sharded, peft_case("embeddings-untied"), "fsdp2 embeddings", atol=1e-6)

        for case in ("all-linear", "dora-modules-to-save", "moe-experts"):
            for orig in (False, True):
                model = peft_case(case)
                # PEFT's own policy: every LoRA factor a unit of its own, apart from its base weight's.
                wrapped = FullyShardedDataParallel(
                    model, auto_wrap_policy=fsdp_auto_wrap_policy(model), device_id=torch.device("cpu"), use_orig_params=orig
                )
                assert ModuleSource(wrapped).scheme == "fsdp1"
                assert_sends_like(wrapped, peft_case(case), f"fsdp1 {case} use_orig_params={orig}")
        out["ok"] = True
    finally:
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps(out))
        leave_group_together()


@pytest.mark.slow
def test_fsdp2_and_fsdp1_send_what_the_unsharded_model_sends(tmp_path):
    mp.spawn(_fsdp_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    assert json.loads((tmp_path / "result.json").read_text()) == {"ok": True}


def _zero3_rank(rank: int, port: int, out_dir: str) -> None:
    import deepspeed

    from wt_callbacks.demos.deepspeed_cpu import skip_shm_comm_op

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo", timeout=TIMEOUT)
    out: dict = {}
    try:
        for case in ("all-linear", "dora-modules-to-save", "moe-experts", "lora-bias"):
            engine = deepspeed_engine(peft_case(case), 3, stage3_param_persistence_threshold=0)
            assert ModuleSource(engine).scheme == "zero3"
            assert_sends_like(engine, peft_case(case), f"zero3 {case}")
        out["ok"] = True
    finally:
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps(out))
        leave_group_together()


@pytest.mark.slow
def test_zero3_sends_what_the_unsharded_model_sends(tmp_path):
    pytest.importorskip("deepspeed")
    mp.spawn(_zero3_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    assert json.loads((tmp_path / "result.json").read_text()) == {"ok": True}
