"""Tiny causal LMs of the families RL users train, built offline from configs.

Two layers, hidden 64, head_dim 32 (the smallest vLLM's CPU attention takes),
a 300-token vocabulary: small enough to build in milliseconds and for a vLLM
server to start quickly, big enough to have every kind of weight the real
architecture has (fused MoE experts, tied embeddings, q/k norms, qkv bias,
Conv1D). Built with the default seed they are what a receiver serves
(``--module-factory wt_callbacks.demos.tiny_lms:qwen3_moe``); a trainer
builds its own copy from another seed, so equal checksums after a sync
prove every byte moved.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from wt_callbacks.demos.models import RECEIVER_SEED

VOCAB = 300


def _build(config_cls: str, model_cls: str, seed: int, **config: object) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**config)
    return getattr(transformers, model_cls)(cfg).eval()


def qwen3_moe(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    return _build(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", seed, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip


def llama_tied(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    return _build(
        "LlamaConfig", "LlamaForCausalLM", seed, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
    )  # fmt: skip


def gpt2(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    return _build(
        "GPT2Config", "GPT2LMHeadModel", seed, vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


TINY_LMS: dict[str, Callable[..., torch.nn.Module]] = {"qwen3_moe": qwen3_moe, "llama_tied": llama_tied, "gpt2": gpt2}
