"""What the source sends is what ``save_pretrained`` writes (issue: fused MoE experts).

transformers 5 keeps MoE experts packed in memory and writes them per expert;
servers load the per-expert names. These tests compare ``ModuleSource`` with
the checkpoint ``save_pretrained`` writes for the same model, tensor for
tensor, and check the receiver side takes that format back in.
"""

from __future__ import annotations

import torch
from torch import nn
import pytest
from safetensors.torch import load_file

from wt_callbacks.demos.tiny_lms import TINY_LMS
from wt_callbacks.transfer import ModuleSource
from wt_callbacks.transfer.sources.checkpoint_format import CheckpointLayout


def saved_checkpoint(model: nn.Module, tmp_path) -> dict[str, torch.Tensor]:
    model.save_pretrained(tmp_path)
    tensors = {}
    for file in sorted(tmp_path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("family", sorted(TINY_LMS))
def test_source_sends_what_save_pretrained_writes(family, tmp_path):
    model = TINY_LMS[family](seed=0)
    source = ModuleSource(model)
    metas = source.metadata()
    sent = list(source)
    saved = saved_checkpoint(model, tmp_path)
    assert [m.name for m in metas] == [n for n, _ in sent]
    assert {m.name: (m.dtype, m.shape) for m in metas} == {n: (t.dtype, tuple(t.shape)) for n, t in saved.items()}
    for name, tensor in sent:
        assert torch.equal(tensor, saved[name]), name


def test_moe_experts_go_per_expert_and_come_back_packed():
    model = TINY_LMS["qwen3_moe"](seed=0)
    names = [m.name for m in ModuleSource(model).metadata()]
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(model.named_parameters())
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
    # The receiver's direction: checkpoint tensors in, the model's layout out.
    layout = CheckpointLayout(model)
    params = dict(model.named_parameters())
    sent = dict(ModuleSource(model))
    from wt_callbacks.transfer import ParamMeta

    for group in layout.plan([ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in params.items()]):
        back = layout.to_memory(group, {o.name: sent[o.name] for o in group.outputs})
        assert set(back) == set(group.inputs)
        for name, tensor in back.items():
            assert torch.equal(tensor, params[name]), name


def test_wire_dtype_selection_and_prefix_of_a_wrapped_model():
    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = TINY_LMS["qwen3_moe"](seed=0)
            self.value_head = nn.Linear(64, 1)

    policy = Policy()
    whole = ModuleSource(policy, dtype=torch.bfloat16, exclude=["value_head.*", "*.experts.[123].*"])
    metas = whole.metadata()
    assert all(m.name.startswith("model.") for m in metas)
    assert "model.model.layers.1.mlp.experts.0.down_proj.weight" in [m.name for m in metas]
    assert not any(".experts.2." in m.name for m in metas)
    sent = list(whole)
    assert [m.name for m in metas] == [n for n, _ in sent]
    assert {t.dtype for _, t in sent} == {torch.bfloat16}
    only_lm = ModuleSource(policy, submodule="model")
    assert [m.name for m in only_lm.metadata()] == [m.name for m in ModuleSource(policy.model).metadata()]


def test_plain_module_is_sent_as_it_is():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    sent = list(ModuleSource(model))
    assert [n for n, _ in sent] == [n for n, _ in model.named_parameters()]
    assert all(t.data_ptr() == p.data_ptr() for (_, t), p in zip(sent, model.parameters()))


def test_a_conversion_transformers_cannot_reverse_fails_at_setup_naming_the_parameter():
    from transformers.core_model_loading import ConversionOps, WeightConverter

    class OneWay(ConversionOps):
        """A load-time conversion registered without a reverse."""

        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            return {target_patterns[0]: torch.stack(next(iter(input_dict.values())))}

    model = TINY_LMS["qwen3_moe"](seed=0)
    model._weight_conversions = [
        WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", operations=[OneWay()])
    ]
    with pytest.raises(ValueError, match=r"cannot send 'model.layers.0.mlp.experts.down_proj' in checkpoint format: transformers' conversion of Qwen3MoeForCausalLM does not reverse"):
        ModuleSource(model)


@pytest.mark.parametrize("family", sorted(TINY_LMS))
def test_receiver_takes_the_checkpoint_format_back(family, receiver_proc):
    """A push into a receiver process serving another copy of the family: bitwise
    equal in the receiver's own layout (packed experts for the MoE)."""
    from tests.support.transfer import connect
    from wt_callbacks.checksums import module_checksums
    from wt_callbacks.demos.receiver_process import receiver_checksums

    trainer = TINY_LMS[family](seed=0)
    receiver = receiver_proc(f"wt_callbacks.demos.tiny_lms:{family}")
    assert receiver_checksums(receiver.url) != module_checksums(trainer)
    client, engine = connect(receiver.url, ModuleSource(trainer))
    try:
        engine.send_weights("v1")
    finally:
        engine.shutdown()
        client.close()
    assert receiver_checksums(receiver.url) == module_checksums(trainer)
