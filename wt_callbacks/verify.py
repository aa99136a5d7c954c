"""Is the server serving the weights we sent? Greedy logprobs of fixed probes, compared.

A weight round can succeed on every HTTP call and still leave a server on
wrong weights (a tied ``lm_head`` a reload skipped, a layout it misread).
Checksums cannot tell: vLLM repacks weights into its kernels' layouts. What
can is the model's output: ask each server for the greedy continuation of a
few fixed prompts, with logprobs, and compute the trainer model's logprobs of
the same tokens (teacher forcing). Equal weights give equal logprobs up to
the numerics of two implementations (about 1e-6 in float32); a stale or
garbled layer moves them by whole nats. NeMo-RL ships the same check as its
refit verifier.

Prompts are token ids, so no tokenizer is involved on either side, and they
are fixed (seeded) so that every check of a run asks the same question.

A data-parallel vLLM server runs one engine per DP rank behind one URL, and
its balancer picks an engine per request: each engine is asked on its own
(vLLM's ``X-data-parallel-rank`` header), and reported as ``<url>#dp<rank>``.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import requests
import torch

from wt_callbacks.transfer.auth import bearer_headers

logger = logging.getLogger(__name__)

DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"
"""vLLM's request header that sends a request to one data-parallel engine."""

DEFAULT_TOLERANCES = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.05}
"""Default bound on |logprob difference| by wire dtype. float32 weights give
~1e-6; a bf16 wire rounds every weight the server holds while the trainer's
model keeps float32, measured here at ~1e-2 on tiny models; wrong weights
give differences of whole nats."""


@dataclass(frozen=True)
class ProbeSet:
    """The fixed probe prompts and how many greedy tokens each is asked for."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int

    @classmethod
    def for_vocab(cls, vocab_size: int, *, count: int = 4, length: int = 8, max_tokens: int = 4, seed: int = 0) -> ProbeSet:
        """``count`` prompts of ``length`` token ids drawn (seeded) from the vocabulary;
        ids near 0 (often special tokens) are avoided."""
        if vocab_size < 8:
            raise ValueError(f"vocab_size={vocab_size} is too small to probe")
        rng = random.Random(seed)
        low = min(4, vocab_size // 4)
        prompts = tuple(tuple(rng.randrange(low, vocab_size) for _ in range(length)) for _ in range(count))
        return cls(prompts, max_tokens)


def vocab_size_of(model: torch.nn.Module) -> int:
    """The output vocabulary of a causal LM; ``ValueError`` if ``model`` is not one."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(
            f"{type(model).__name__} is not a causal LM with an output head (get_output_embeddings()); "
            "verification compares the servers' logprobs with the trainer model's: set module: to the "
            "submodule that is the served transformers model, or turn verification off"
        )
    # ZeRO-3 partitions the weight (its shape is then empty): its full shape is ds_shape.
    return int(getattr(head.weight, "ds_shape", head.weight.shape)[0])


def served_completion(
    url: str, model_name: str | None, prompt: Sequence[int], max_tokens: int, *, timeout_s: float, api_key: str | None = None,
    data_parallel_rank: int | None = None,
) -> tuple[list[int], list[float]]:
    """The server's greedy continuation of ``prompt``: token ids and their
    logprobs (from its data-parallel engine ``data_parallel_rank``, if given)."""
    body: dict[str, Any] = {
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }
    if model_name is not None:
        body["model"] = model_name
    headers = bearer_headers(api_key)
    if data_parallel_rank is not None:
        headers[DATA_PARALLEL_RANK_HEADER] = str(data_parallel_rank)
    answer = requests.post(f"{url.rstrip('/')}/v1/completions", json=body, headers=headers, timeout=timeout_s)
    if answer.status_code != 200:
        raise RuntimeError(f"{url}/v1/completions answered {answer.status_code}: {answer.text[:300]}")
    logprobs = answer.json()["choices"][0]["logprobs"]
    tokens = [int(str(t).removeprefix("token_id:")) for t in logprobs["tokens"]]
    return tokens, [float(x) for x in logprobs["token_logprobs"]]


def served_model_name(url: str, *, timeout_s: float, api_key: str | None = None) -> str | None:
    """The name completions must carry (``GET /v1/models``), or None if the server lists none."""
    headers = bearer_headers(api_key)
    answer = requests.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=timeout_s)
    answer.raise_for_status()
    data = answer.json().get("data") or []
    return data[0]["id"] if data else None


def data_parallel_size(url: str, *, timeout_s: float, api_key: str | None = None) -> int:
    """How many data-parallel engines serve behind ``url``: vLLM's world size
    with them (``GET /get_world_size``) over its world size without. 1 for a
    server without the route (vLLM outside dev mode), which is said in the log."""
    headers = bearer_headers(api_key)
    sizes = []
    for include_dp in ("true", "false"):
        answer = requests.get(
            f"{url.rstrip('/')}/get_world_size", params={"include_dp": include_dp}, headers=headers, timeout=timeout_s
        )
        if answer.status_code == 404:
            logger.warning(
                "%s has no /get_world_size (vLLM without VLLM_SERVER_DEV_MODE=1): verification asks whichever "
                "engine it picks, as if it ran one", url,
            )  # fmt: skip
            return 1
        answer.raise_for_status()
        sizes.append(int(answer.json()["world_size"]))
    return max(1, sizes[0] // max(1, sizes[1]))


def engine_label(url: str, data_parallel_rank: int | None) -> str:
    """How results name an engine: the URL, with ``#dp<rank>`` on a data-parallel server."""
    return url if data_parallel_rank is None else f"{url}#dp{data_parallel_rank}"


@torch.no_grad()
def teacher_forced_logprobs(model: torch.nn.Module, prompt: Sequence[int], tokens: Sequence[int]) -> list[float]:
    """``model``'s logprobs of ``tokens`` following ``prompt``. Under FSDP the
    forward is a collective: every rank calls it with the same arguments."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = torch.tensor([list(prompt) + list(tokens)], device=device)
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids).logits[0].float()
    finally:
        model.train(was_training)
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def query_servers(
    urls: Sequence[str], probes: ProbeSet, *, timeout_s: float, api_key: str | None = None, model_name: str | None = None
) -> dict[str, list[tuple[list[int], list[float]]]]:
    """Every engine's greedy tokens and logprobs for every probe (rank 0
    only), by ``engine_label``: each data-parallel engine of a server on its
    own; from ``model_name`` (a LoRA adapter a server serves) or the served
    model."""
    out = {}
    for url in urls:
        name = model_name or served_model_name(url, timeout_s=timeout_s, api_key=api_key)
        engines = data_parallel_size(url, timeout_s=timeout_s, api_key=api_key)
        for rank in range(engines) if engines > 1 else [None]:
            out[engine_label(url, rank)] = [
                served_completion(
                    url, name, prompt, probes.max_tokens, timeout_s=timeout_s, api_key=api_key, data_parallel_rank=rank
                )
                for prompt in probes.prompts
            ]
    return out


def max_logprob_diff(
    model: torch.nn.Module, probes: ProbeSet, served: dict[str, list[tuple[list[int], list[float]]]]
) -> dict[str, float]:
    """Per engine (the keys of ``served``), the largest |served - trainer| logprob over every probe token."""
    worst: dict[str, float] = {}
    for url, answers in served.items():
        worst[url] = 0.0
        for prompt, (tokens, logprobs) in zip(probes.prompts, answers):
            expected = teacher_forced_logprobs(model, prompt, tokens)
            worst[url] = max([worst[url], *(_distance(a, b) for a, b in zip(logprobs, expected))])
    return worst


def _distance(served: float, expected: float) -> float:
    """|served - expected|, infinite when either is not finite: ``max`` keeps
    its first argument over a NaN and ``nan > tolerance`` is false, so a
    server whose weights went NaN would otherwise pass."""
    d = abs(served - expected)
    return d if math.isfinite(d) else math.inf


def served_logprob_diff(
    model: torch.nn.Module, urls: str | Sequence[str], *, timeout_s: float = 60.0, api_key: str | None = None,
    probes: ProbeSet | None = None, model_name: str | None = None,
) -> dict[str, float]:
    """Check what servers serve against ``model`` (a transformers causal LM), one process.

    Returns the largest |logprob difference| per server URL, or per engine
    (``<url>#dp<rank>``) of a data-parallel server; about 1e-6 when a
    float32 server holds ``model``'s weights, whole nats when it does not.
    ``model_name``: the served name to ask (a LoRA adapter's, for a PEFT
    ``model`` synced with ``lora: adapter``); default the served model.
    For a sharded model use ``WeightSync``'s ``verify_every_n_syncs``, which
    runs the trainer's forward on every rank.
    """
    urls = [urls] if isinstance(urls, str) else list(urls)
    probes = probes or ProbeSet.for_vocab(vocab_size_of(model))
    answers = query_servers(urls, probes, timeout_s=timeout_s, api_key=api_key, model_name=model_name)
    return max_logprob_diff(model, probes, answers)


class Verifier:
    """Checks, after a round, that the servers serve the trainer's model.

    Trainer rank 0 queries the servers (every engine of a data-parallel
    one) and broadcasts their answers; every rank then runs the trainer
    model's forward on them (a collective when the model is sharded) and the
    largest difference decides; the difference per engine is logged.
    ``model_name``: the served name to ask
    (``lora: adapter``'s ``lora_name``).
    """

    def __init__(
        self, model: torch.nn.Module, urls: Sequence[str], *, tolerance: float, timeout_s: float,
        api_key: str | None = None, probes: ProbeSet | None = None, model_name: str | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.model_name = model_name
        self.urls = list(urls)
        self.tolerance = tolerance
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.probes = probes or ProbeSet.for_vocab(vocab_size_of(model))

    @classmethod
    def for_config(cls, config: Any, source: Any) -> Verifier:
        """The verifier of a ``SyncConfig`` for the module ``source`` sends.

        Raises:
            ValueError: the sent module is not a causal LM (the check needs its logits).
        """
        import os

        from wt_callbacks.naming import find_submodule

        model = find_submodule(source.module, config.module)
        vocab = vocab_size_of(model)
        wire = config.dtype or str(model.get_output_embeddings().weight.dtype).removeprefix("torch.")
        tolerance = config.verify_tolerance or DEFAULT_TOLERANCES.get(wire, max(DEFAULT_TOLERANCES.values()))
        return cls(
            model, config.servers, tolerance=tolerance, timeout_s=config.timeout_s,
            api_key=config.api_key or os.environ.get("VLLM_API_KEY") or None,
            probes=ProbeSet.for_vocab(vocab),
            model_name=config.lora_name if config.lora == "adapter" else None,
        )  # fmt: skip

    def check(self, rank: int = 0, world_size: int = 1, collectives: Any = None) -> float:
        """The largest |logprob difference| over every engine of every server; call on every rank.

        Raises:
            RuntimeError: a server does not answer, or serves logprobs
                further from the trainer's than ``tolerance``.
        """
        answers = None
        if rank == 0:
            answers = query_servers(self.urls, self.probes, timeout_s=self.timeout_s, api_key=self.api_key, model_name=self.model_name)
        if world_size > 1:
            answers = collectives.broadcast(answers)
        diffs = max_logprob_diff(self.model, self.probes, answers)
        logger.info("verification: max |logprob diff| per engine: %s", ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
        url = max(diffs, key=diffs.__getitem__)
        if diffs[url] > self.tolerance:
            raise RuntimeError(
                f"verification failed: {url} serves logprobs up to {diffs[url]:.3g} nats away from the "
                f"trainer's model on the probe prompts (verify_tolerance {self.tolerance:g}): the server "
                "does not serve the weights sent"
            )
        return diffs[url]
