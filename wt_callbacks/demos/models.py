"""Small models for tests and demos, built offline and deterministically.

A receiver subprocess builds them through ``--module-factory
wt_callbacks.demos.models:<name>``; the receiver's copy starts from a different
seed than the trainer's, so a passing checksum comparison proves the sync
moved every byte.
"""

from __future__ import annotations

import torch
from torch import nn

RECEIVER_SEED = 1234


class MixedModel(nn.Module):
    """fp32 and bf16 parameters, one of them non-contiguous, one large tensor."""

    def __init__(self, hidden: int = 48, vocab: int = 300) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.low_precision = nn.Linear(hidden, 2 * hidden).to(torch.bfloat16)
        # A transposed view: C-contiguous only after .contiguous().
        self.transposed = nn.Parameter(torch.randn(2 * hidden, hidden).t())
        self.head = nn.Linear(hidden, vocab, bias=False)


class TinyMLP(nn.Module):
    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def mixed_model(seed: int = RECEIVER_SEED) -> nn.Module:
    torch.manual_seed(seed)
    return MixedModel()


def tiny_mlp(seed: int = RECEIVER_SEED) -> nn.Module:
    torch.manual_seed(seed)
    return TinyMLP()


def many_tensors(seed: int = RECEIVER_SEED) -> nn.Module:
    """300 small tensors: where one collective per tensor hurts."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(150)])


def ring_overflow(seed: int = RECEIVER_SEED) -> nn.Module:
    """One 18.9 MB fp32 weight: larger than the whole shm ring (16 MiB), so it
    streams through every slot more than once."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(2048, 2304))


def wide_mlp(seed: int = RECEIVER_SEED) -> nn.Module:
    """Sixteen 512x512 layers (16.8 MB in fp32, about 1 MiB each): large
    against a small transfer bucket, for measuring what a round adds to
    the trainer's memory."""
    torch.manual_seed(seed)
    return TinyMLP(width=512, depth=16)
