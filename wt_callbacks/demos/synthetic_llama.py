"""A Llama-shaped fp32 model of any size, for benchmarks: weights only, built fast, seeded.

``build_model(shape_for(parse_size("200M")), seed)`` has the parameter names
and shapes of a Hugging Face Llama (embedding, decoder layers of q/k/v/o +
gate/up/down and two norms, final norm, lm_head) in plain ``torch.nn``, no
forward. A receiver process serves the same shape from another seed through
``--module-factory wt_callbacks.demos.synthetic_llama:receiver_model`` (the
size in ``PARAMS_ENV``), so a passing checksum proves the weights travelled.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import nn

PARAMS_ENV = "WT_BENCH_PARAMS"
"""Environment variable carrying the size (``"200M"``) to ``receiver_model``."""
TRAINER_SEED = 0
RECEIVER_SEED = 12345


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of the synthetic Llama-shaped model."""

    hidden: int
    layers: int
    vocab: int
    intermediate: int

    @property
    def num_params(self) -> int:
        h, i = self.hidden, self.intermediate
        per_layer = 4 * h * h + 3 * h * i + 2 * h
        return 2 * self.vocab * h + self.layers * per_layer + h


def parse_size(text: str) -> int:
    """``"100M"`` -> 100_000_000; accepts K, M, B/G suffixes and plain integers."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}
    text = text.strip().upper()
    if text and text[-1] in scale:
        return int(float(text[:-1]) * scale[text[-1]])
    return int(text)


def shape_for(target_params: int) -> ModelShape:
    """A Llama-like shape with about ``target_params`` parameters.

    Vocab is ``min(32000, 64 * hidden)`` and the MLP width is 8/3 of hidden
    rounded up to a multiple of 64 (Llama's ratios). The hidden size is the
    largest power-of-two-ish width whose layer count stays >= hidden / 32,
    i.e. a model deeper than it is wide, as real LLMs are.
    """
    best = None
    for hidden in (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096):
        vocab = min(32000, 64 * hidden)
        intermediate = 64 * math.ceil(8 * hidden / 3 / 64)
        probe = ModelShape(hidden, 1, vocab, intermediate)
        per_layer = probe.num_params - ModelShape(hidden, 0, vocab, intermediate).num_params
        layers = round((target_params - 2 * vocab * hidden - hidden) / per_layer)
        if layers >= max(1, hidden // 32):
            best = ModelShape(hidden, layers, vocab, intermediate)
    if best is None:
        raise ValueError(f"--params {target_params} is too small for this model family (minimum about 1M)")
    return best


class DecoderLayer(nn.Module):
    """The parameters of one Llama decoder layer (no forward: only weights are synced)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.self_attn = nn.ModuleDict(
            {name: nn.Linear(hidden, hidden, bias=False) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        )
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(hidden, intermediate, bias=False),
                "up_proj": nn.Linear(hidden, intermediate, bias=False),
                "down_proj": nn.Linear(intermediate, hidden, bias=False),
            }
        )
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.empty(hidden))
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = nn.Parameter(torch.empty(hidden))


class SyntheticLlama(nn.Module):
    """Llama-shaped parameter container with Hugging Face parameter names."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(shape.vocab, shape.hidden)
        self.model.layers = nn.ModuleList(DecoderLayer(shape.hidden, shape.intermediate) for _ in range(shape.layers))
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(torch.empty(shape.hidden))
        self.lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False)


def reseed(model: nn.Module, seed: int) -> None:
    """Overwrite every parameter in place with seeded values (N(0, 0.02); norms around 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.02, generator=generator)
            if "norm" in name:
                param.add_(1.0)


def build_model(shape: ModelShape, seed: int) -> SyntheticLlama:
    """The synthetic fp32 model, allocated without torch's default init, then seeded."""
    with torch.device("meta"):
        model = SyntheticLlama(shape)
    model = model.to_empty(device="cpu")
    reseed(model, seed)
    return model


def receiver_model() -> nn.Module:
    """Module factory for the receiver process: same shape, different seed."""
    return build_model(shape_for(parse_size(os.environ[PARAMS_ENV])), RECEIVER_SEED)
