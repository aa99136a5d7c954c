"""Tiny causal LMs of the families RL users train, built offline from configs.

Two layers, hidden 64, head_dim 32 (the smallest vLLM's CPU attention takes)
and the toy task's 20-token vocabulary, so a vLLM server starts as fast as it
can and the toy task trains them. Each has every kind of weight its real
architecture has: tied embeddings (Llama-3.2, Qwen2.5/3 small, Gemma),
q/k norms (Qwen3, Gemma-3), qkv bias (Qwen2), fused MoE experts that
transformers keeps packed in memory under other names than its checkpoints'
(Qwen3-MoE; Mixtral's ``block_sparse_moe.experts.{e}.w1``; Qwen2-MoE's
shared expert and its gate beside them), multi-head latent attention and a
router bias held as a persistent buffer (DeepSeek-V3), norms after attention
and MLP (OLMo-2), fused qkv and gate_up (Phi-3), Conv1D layouts (GPT-2).

Built with the default seed they are what a receiver serves
(``--module-factory wt_callbacks.demos.tiny_lms:qwen3_moe``); a trainer builds
its own copy from another seed, so equal checksums after a sync prove every
byte moved. ``save_pretrained(family, DIR)`` writes one, with the toy
tokenizer, where vLLM loads it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from wt_callbacks.demos import toy_task
from wt_callbacks.demos.models import RECEIVER_SEED

HIDDEN = 64
LAYERS = 2
HEAD_DIM = 32
MAX_POSITIONS = 128
INIT_STD = 0.1
"""Larger than transformers' 0.02, so random logits are far from uniform and a
stale layer shows in the logprobs."""


def _token_ids() -> dict[str, Any]:
    vocab = toy_task.SPECIALS + toy_task.LETTERS + [toy_task.SEP]
    return {
        "vocab_size": len(vocab),
        "pad_token_id": vocab.index("<pad>"),
        "bos_token_id": vocab.index("<bos>"),
        "eos_token_id": vocab.index("<eos>"),
        "initializer_range": INIT_STD,
    }


def _decoder(**extra: Any) -> dict[str, Any]:
    return {
        **_token_ids(),
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HIDDEN // HEAD_DIM,
        "num_key_value_heads": 1,
        "max_position_embeddings": MAX_POSITIONS,
        **extra,
    }


def _build(config_cls: str, model_cls: str, seed: int, config: dict[str, Any]) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config)).float().eval()


def llama_untied(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    return _build("LlamaConfig", "LlamaForCausalLM", seed, _decoder(head_dim=HEAD_DIM, tie_word_embeddings=False))


def llama_tied(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    return _build("LlamaConfig", "LlamaForCausalLM", seed, _decoder(head_dim=HEAD_DIM, tie_word_embeddings=True))


def qwen2_tied(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    return _build("Qwen2Config", "Qwen2ForCausalLM", seed, _decoder(tie_word_embeddings=True))


def qwen3_tied(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    return _build("Qwen3Config", "Qwen3ForCausalLM", seed, _decoder(head_dim=HEAD_DIM, tie_word_embeddings=True))


def qwen3_moe(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    return _build(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", seed,
        _decoder(
            head_dim=HEAD_DIM, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=HIDDEN, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        ),
    )  # fmt: skip


def mixtral(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    return _build(
        "MixtralConfig", "MixtralForCausalLM", seed,
        _decoder(head_dim=HEAD_DIM, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2),
    )  # fmt: skip


def qwen2_moe(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    return _build(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM", seed,
        _decoder(
            tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
            shared_expert_intermediate_size=2 * HIDDEN, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
        ),
    )  # fmt: skip


def deepseek_v3(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    return _build(
        "DeepseekV3Config", "DeepseekV3ForCausalLM", seed,
        _decoder(
            tie_word_embeddings=False, num_key_value_heads=HIDDEN // HEAD_DIM, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, moe_intermediate_size=HIDDEN, first_k_dense_replace=1, n_group=1, topk_group=1,
            q_lora_rank=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
            rope_scaling=None, topk_method="noaux_tc", scoring_func="sigmoid",
        ),
    )  # fmt: skip


def olmo2(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    return _build("Olmo2Config", "Olmo2ForCausalLM", seed, _decoder(tie_word_embeddings=False))


def gemma3_text(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    return _build(
        "Gemma3TextConfig", "Gemma3ForCausalLM", seed,
        _decoder(head_dim=HEAD_DIM, tie_word_embeddings=True, query_pre_attn_scalar=HEAD_DIM, sliding_window=MAX_POSITIONS),
    )  # fmt: skip


def phi3(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    return _build("Phi3Config", "Phi3ForCausalLM", seed, _decoder(tie_word_embeddings=False))


def gpt2(seed: int = RECEIVER_SEED) -> torch.nn.Module:
    ids = _token_ids()
    return _build(
        "GPT2Config", "GPT2LMHeadModel", seed,
        {
            **ids, "n_positions": MAX_POSITIONS, "n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HIDDEN // HEAD_DIM,
            "tie_word_embeddings": True,
        },
    )  # fmt: skip


TINY_LMS: dict[str, Callable[..., torch.nn.Module]] = {
    f.__name__: f for f in (llama_untied, llama_tied, qwen2_tied, qwen3_tied, qwen3_moe, mixtral, qwen2_moe, deepseek_v3, olmo2, gemma3_text, phi3, gpt2)
}


def save_pretrained(family: str, directory: str | Path, *, seed: int = RECEIVER_SEED) -> Path:
    """Write family ``family`` (untrained, from ``seed``) and the toy tokenizer into ``directory``."""
    directory = Path(directory)
    TINY_LMS[family](seed).save_pretrained(directory)
    toy_task.build_tokenizer().save_pretrained(directory)
    return directory


MOE_SHAPE_ENV = "WT_QWEN3_MOE_SHAPE"
"""``"layers,experts,hidden"`` of ``sized_qwen3_moe_receiver``'s model (benchmarks)."""


def sized_qwen3_moe(layers: int, experts: int, hidden: int, *, seed: int = RECEIVER_SEED) -> torch.nn.Module:
    """A Qwen3-MoE of real proportions (32k vocabulary, 8 experts per token), for benchmarks."""
    return _build(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", seed,
        {
            "vocab_size": 32000, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "moe_intermediate_size": hidden // 2, "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
            "num_key_value_heads": 2, "head_dim": 64, "num_experts": experts, "num_experts_per_tok": 8,
            "tie_word_embeddings": False,
        },
    )  # fmt: skip


def sized_qwen3_moe_receiver() -> torch.nn.Module:
    """``--module-factory`` target: ``sized_qwen3_moe`` of the shape in ``WT_QWEN3_MOE_SHAPE``."""
    import os

    layers, experts, hidden = (int(x) for x in os.environ[MOE_SHAPE_ENV].split(","))
    return sized_qwen3_moe(layers, experts, hidden)
