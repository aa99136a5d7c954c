"""A tiny causal LM and a toy task it visibly learns in a minute on a CPU.

Task: reverse four letters. The prompt ``"c a f b |"`` is answered ``"b f a c"``.
Everything is built offline (no downloads): a word-level tokenizer over the
letters ``a``-``p`` and a 2-layer Llama whose shapes also suit vLLM's CPU
backend (head_dim 32). Shared by the examples, the tests and the vLLM benchmark.

    python -m wt_callbacks.demos.toy_task DIR     # write the untrained model + tokenizer to DIR
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

LETTERS = [chr(ord("a") + i) for i in range(16)]
SEP = "|"
SPECIALS = ["<pad>", "<bos>", "<eos>"]
WORD_COUNT = 4


def build_tokenizer():
    """Word-level tokenizer; prompts are encoded as ``<bos> a b c d |``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + LETTERS + [SEP])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    from tokenizers import decoders

    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<pad>"
    )


def build_model(tokenizer, *, seed: int = 0, hidden_size: int = 64, layers: int = 2):
    """A small Llama (fp32). ``head_dim=32``: vLLM's CPU attention needs >= 32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def served_model():
    """What a receiver serves before the first sync: the model from another seed
    than the trainer's (``--module-factory wt_callbacks.demos.toy_task:served_model``)."""
    return build_model(build_tokenizer(), seed=1)


def embedded_receiver():
    """A started reference receiver in this process serving ``served_model()``
    with the tokenizer (completions included): the examples' server when they
    are given none. Stop it with ``.stop()``."""
    from wt_callbacks.receiver import Receiver

    receiver = Receiver(served_model(), tokenizer=build_tokenizer(), model_name="toy-reverser")
    receiver.start()
    return receiver


def save_pretrained(directory: str | Path, *, seed: int = 0) -> Path:
    """Write an untrained model + tokenizer that ``from_pretrained`` and vLLM load."""
    directory = Path(directory)
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def sample(rng: random.Random) -> tuple[str, str]:
    """One (prompt, answer) pair."""
    words = [rng.choice(LETTERS) for _ in range(WORD_COUNT)]
    return " ".join(words) + f" {SEP}", " ".join(reversed(words))


def held_out_prompts(n: int = 8) -> list[tuple[str, str]]:
    """Fixed evaluation pairs (their own seed, so training rarely sees them)."""
    rng = random.Random(10_000)
    return [sample(rng) for _ in range(n)]


def training_batch(tokenizer, rng: random.Random, batch_size: int) -> dict[str, torch.Tensor]:
    """Full sequences ``<bos> prompt answer <eos>``; the loss covers the answer only."""
    rows, labels = [], []
    for _ in range(batch_size):
        prompt, answer = sample(rng)
        prompt_ids = tokenizer(prompt)["input_ids"]
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        labels.append([-100] * len(prompt_ids) + answer_ids)
    return {"input_ids": torch.tensor(rows), "labels": torch.tensor(labels)}


def accuracy(answers: list[str], pairs: list[tuple[str, str]]) -> float:
    return sum(a.strip() == expected for a, (_, expected) in zip(answers, pairs)) / len(pairs)


def main() -> None:
    """``python -m wt_callbacks.demos.toy_task DIR``: write the untrained model + tokenizer to DIR."""
    import sys

    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m wt_callbacks.demos.toy_task OUTPUT_DIR")
    print(save_pretrained(sys.argv[1], seed=1))


if __name__ == "__main__":
    main()
