"""The receiver's core: one model, its worker engine and the weight-update lifecycle.

Beyond vLLM it reports ``updates_completed`` and ``version_history``
(``weight_info``) and sha256 checksums per parameter (``weight_checksums``),
so a test can prove a sync was bitwise exact. Updates are transactional:
``StagedWeights`` copies a round's tensors into a spare set of parameters as
they arrive and swaps it in only when ``finish_weight_update`` succeeds, so an
interrupted round leaves the old weights in place; a staged round streams
while the receiver keeps generating, and only its commit takes the lock that
generation holds. ``reload_weights`` is
vLLM's reload-from-disk alternative to pushing. The HTTP app and the Ray
actor are thin fronts over ``ReceiverCore``.
"""

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from wt_callbacks.checksums import module_checksums
from wt_callbacks.receiver.adapters import ServedAdapters
from wt_callbacks.receiver.staging import StagedWeights
from wt_callbacks.transfer.base import WeightTransferConfig, WeightTransferUpdatePayload
from wt_callbacks.transfer.factory import WeightTransferEngineFactory
from wt_callbacks.transfer.sources.checkpoint_format import CheckpointLayout

logger = logging.getLogger(__name__)

COMPLETION_PAUSE_WAIT_S = 300.0
"""How long a completion request waits for a paused receiver to resume."""

MAX_COMPLETIONS_N = 64
"""The most completions per prompt. vLLM takes up to 16384
(``VLLM_MAX_N_SEQUENCES``), scheduled among other requests; here the ``n``
rows are one batch, generated under the lock a weight update waits for."""

MAX_MODEL_LEN_KEYS = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
    "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len",
)  # fmt: skip
"""The config keys vLLM derives ``max_model_len`` from (the smallest one set;
2048 without any), in its order."""


class BadRequest(ValueError):
    """A request refused as vLLM refuses it, with HTTP 400; the message says what to fix."""


def max_model_len(model: torch.nn.Module) -> int:
    """The context length vLLM would serve ``model`` with (prompt plus output tokens)."""
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "get_text_config", None)):
        config = config.get_text_config()
    lengths = [getattr(config, key, None) for key in MAX_MODEL_LEN_KEYS]
    return min((n for n in lengths if isinstance(n, int)), default=2048)


def _host_config(world_size: int = 1) -> SimpleNamespace:
    """The slice of vLLM's ``VllmConfig`` a worker engine reads."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=world_size, rank=0),
        model_config=None,
    )


class ReceiverCore:
    """Lifecycle of weight updates around one model (shared by HTTP and Ray).

    Misuse answers as vLLM does: update or finish without start, and a second
    start, raise ``RuntimeError``; a failed update ends the update (the stage
    is dropped, as vLLM clears its active flag). Whether it also ends the
    transfer session is the worker engine's call: only a failure of the
    group does, a request refused before any byte moved does not. A failed
    update also resumes generation: the trainer that paused it may be gone.

    ``api_key``: the token the engine requires at ``init_weight_transfer_engine``
    (default: ``VLLM_API_KEY``, as inside vLLM; see ``session``).
    """

    def __init__(
        self, model: torch.nn.Module, *, backend: str = "torch_dist", tokenizer: Any = None, api_key: str | None = None
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend=backend), _host_config(), device, model
        )
        if api_key is not None:
            self.engine.api_key = api_key
        self.weight_version = "default"
        self.version_history: list[str] = []
        self.updates_completed = 0
        self._stage: StagedWeights | None = None
        # Planned once: the model's parameters do not change shape.
        self._layout = CheckpointLayout(model)
        self._spares: dict[str, torch.Tensor] = {}
        # One weight operation at a time, as vLLM's engine core runs them;
        # generation takes it too, so it never sees a half-applied round.
        self._lock = threading.Lock()
        # LoRA adapters loaded by name (/v1/load_lora_adapter), applied to
        # the base weights of ``_base_version``, counted per applied round.
        self.adapters = ServedAdapters()
        self._base_version = 0
        self._unpaused = threading.Event()
        self._unpaused.set()
        self.pause_mode: str | None = None
        self._update_started = 0.0

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    @property
    def refuses_new_requests(self) -> bool:
        """vLLM 0.33: paused with ``abort`` or ``wait``, new requests are
        answered 503 until ``resume``; ``keep`` queues them."""
        return self.paused and self.pause_mode != "keep"

    def pause(self, mode: str = "abort") -> None:
        self.pause_mode = mode
        self._unpaused.clear()

    def resume(self) -> None:
        self.pause_mode = None
        self._unpaused.set()

    def complete(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_tokens: int,
        logprobs: bool,
        *,
        ignore_eos: bool = False,
        tokens_as_ids: bool = False,
        temperature: float = 0.0,
        n: int = 1,
        adapter: str | None = None,
    ) -> list[dict[str, Any]]:
        """``n`` completions per prompt, from the model or, named by ``adapter``,
        the model with that loaded LoRA adapter applied: greedy at ``temperature`` 0, else
        sampled (no top-k / top-p, as vLLM's defaults). Choices are in vLLM's
        order (``index = prompt * n + sample``); logprobs are of the model's
        raw distribution, as vLLM reports them by default.

        A prompt is text (needs the tokenizer) or token ids, as vLLM takes
        both; ``ignore_eos`` and ``tokens_as_ids`` are vLLM's
        ``ignore_eos`` and ``return_tokens_as_token_ids`` (tokens reported as
        ``"token_id:N"``, which needs no tokenizer). Called while paused, it
        waits for ``resume`` (at most ``COMPLETION_PAUSE_WAIT_S``), as a request
        vLLM holds under a ``keep`` pause.
        """
        if not callable(getattr(self.model, "generate", None)):
            raise ValueError("this receiver serves no completions: it needs a transformers causal LM")
        needs_tokenizer = not tokens_as_ids or any(isinstance(p, str) for p in prompts)
        if needs_tokenizer and self.tokenizer is None:
            raise ValueError(
                "this receiver has no tokenizer: send prompts as token ids with return_tokens_as_token_ids"
            )
        # Checked before the lock is taken: generation holds it, and the next
        # weight update waits for it.
        if n > MAX_COMPLETIONS_N:
            raise BadRequest(f"n must be at most {MAX_COMPLETIONS_N}, got {n}.")
        context = max_model_len(self.model)
        if max_tokens > context:
            raise BadRequest(
                f"max_tokens={max_tokens} cannot be greater than max_model_len={context}. "
                "Please request fewer output tokens."
            )
        inputs = [self._prompt_input(prompt, max_tokens, context) for prompt in prompts]
        # The HTTP route waited the pause out, but the next round may have
        # paused generation again before this thread ran: wait for it too.
        if not self._unpaused.wait(timeout=COMPLETION_PAUSE_WAIT_S):
            raise TimeoutError(f"generation stayed paused for more than {COMPLETION_PAUSE_WAIT_S:g} s")
        decoding = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else None
        stop_ids = set() if ignore_eos or self.tokenizer is None else {self.tokenizer.eos_token_id}
        choices = []
        with self._lock, torch.no_grad():
            model = self.model if adapter is None else self.adapters.model(adapter, self.model, self._base_version)
            for prompt_index, (ids, budget) in enumerate(inputs):
                ids = ids.to(self.engine.device)
                # One prompt, n rows: equal lengths, so no padding to mask.
                out = model.generate(
                    ids.expand(n, -1),
                    attention_mask=torch.ones_like(ids).expand(n, -1),
                    max_new_tokens=budget,
                    min_new_tokens=budget if ignore_eos else None,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=pad,
                    **decoding,
                )
                for row in range(n):
                    new_ids = out.sequences[row, ids.shape[1] :].tolist()
                    # A row that stopped early is padded to the longest one: cut after its stop token.
                    end = next((i + 1 for i, t in enumerate(new_ids) if t in stop_ids), len(new_ids))
                    new_ids = new_ids[:end]
                    choice: dict[str, Any] = {
                        "index": prompt_index * n + row,
                        "text": self.tokenizer.decode(new_ids, skip_special_tokens=True) if self.tokenizer else "",
                        "finish_reason": "length" if len(new_ids) == budget else "stop",
                    }
                    if logprobs:
                        steps = [torch.log_softmax(logit[row].float(), dim=-1) for logit in out.logits]
                        tokens = (
                            [f"token_id:{t}" for t in new_ids]
                            if tokens_as_ids
                            else self.tokenizer.convert_ids_to_tokens(new_ids)
                        )
                        choice["logprobs"] = {
                            "tokens": tokens,
                            "token_logprobs": [step[t].item() for step, t in zip(steps, new_ids)],
                        }
                    choices.append(choice)
        return choices

    def _prompt_input(self, prompt: str | Sequence[int], max_tokens: int, context: int) -> tuple[torch.Tensor, int]:
        """A prompt's token ids (1 x length) and its ``max_tokens``, cut to the
        room the ``context`` length leaves, as vLLM 0.32 cuts it; a prompt
        that leaves no room, or with ids outside the vocabulary (the
        embedding would raise IndexError), is refused."""
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"]
        else:
            vocab = self.model.get_input_embeddings().num_embeddings
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise BadRequest(f"Token id {bad} is out of vocabulary (the model's has {vocab} tokens)")
            ids = torch.tensor([list(prompt)])
        if ids.shape[1] >= context:
            raise BadRequest(
                f"This model's maximum context length is {context} tokens. However, your prompt contains "
                f"{ids.shape[1]} input tokens, which leaves no room for output tokens. Please reduce the "
                "length of the input prompt."
            )
        return ids, min(max_tokens, context - ids.shape[1])

    def init_weight_transfer_engine(self, init_info: Mapping[str, Any]) -> None:
        with self._lock:
            self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def shutdown_weight_transfer_engine(self) -> None:
        with self._lock:
            if self._stage is not None:
                raise RuntimeError("Cannot shut down weight transfer while a weight update is active.")
            self.engine.shutdown()

    def start_weight_update(self) -> None:
        with self._lock:
            if self._stage is not None:
                raise RuntimeError("A weight update is already active. Call finish_weight_update first.")
            stage = StagedWeights(self.model, self._layout, self._spares)
            self.engine.set_weight_update_target(stage, None)
            try:
                self.engine.start_weight_update()
            except Exception:
                self.engine.reset_weight_update_target()
                raise
            self._stage = stage
            self._update_started = time.perf_counter()

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        """Receive one update into the stage; a staged one (``staged`` in the
        update dict, the trainer's ``commit: staged``) only starts to, and
        generation goes on while it streams (the stage is not the model). A
        prepared one (``commit: prepared``) is staged the same way: what vLLM
        prepares before its commit, the receiver's stage already is (spare
        tensors its commit swaps in)."""
        with self._lock:
            if self._stage is None:
                raise RuntimeError("start_weight_update must be called before update_weights.")
            try:
                # As in vLLM, inside the try: a refused update ends the update.
                if update_info == []:
                    raise BadRequest(
                        "update_info is an empty list; a list holds one entry per worker rank (this server has one)"
                    )
                self.engine.update_weights(update_info[0] if isinstance(update_info, list) else update_info)
            except Exception:
                self._stage = None
                self.engine.reset_weight_update_target()
                self.resume()
                raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        with self._lock:
            if self._stage is None:
                raise RuntimeError("finish_weight_update called without an active weight update.")
            stage = self._stage
        try:
            # A staged update still streaming is waited for without the lock:
            # generation goes on until the commit below.
            self.engine.finish_weight_update()
            with self._lock:
                stage.check_round_complete()
        except Exception:
            # As a refused update: the update ends, nothing of it is applied.
            with self._lock:
                if self._stage is stage:
                    self._stage = None
                    self.engine.reset_weight_update_target()
            self.resume()
            raise
        with self._lock:
            if self._stage is not stage:  # another finish ended it meanwhile
                raise RuntimeError("finish_weight_update called without an active weight update.")
            stage.commit()
            if stage.tensors:  # an adapter round leaves the base as it was
                self._base_version += 1
            self._stage = None
            self.engine.reset_weight_update_target()
            if weight_version is not None:
                self.weight_version = weight_version
            self.updates_completed += 1
            self.version_history.append(self.weight_version)
            received = getattr(self.engine, "last_receive", None)
            logger.info(
                "weight update %s: %d tensors, %.1f MB in %.3f s%s",
                self.weight_version, stage.tensors, stage.bytes / 1e6, time.perf_counter() - self._update_started,
                "" if received is None else f" ({received.waiting_s:.3f} s of it waiting for the trainer's data)",
            )  # fmt: skip

    def reload_weights(self, weights_path: str) -> None:
        """Load every ``*.safetensors`` file in ``weights_path`` (vLLM's
        ``reload_weights`` collective RPC: the reload-from-disk way to sync).

        Validated and applied like a pushed round (all or nothing), but it
        does not change ``weight_version`` or count as an update: vLLM's
        reload does neither.
        """
        from pathlib import Path

        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise RuntimeError("reload_weights needs safetensors: pip install 'wt-callbacks[receiver]'") from e
        files = sorted(Path(weights_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"weights_path={weights_path!r} has no *.safetensors file")
        with self._lock:
            if self._stage is not None:
                raise RuntimeError("Cannot reload weights while a weight update is active.")
            stage = StagedWeights(self.model, self._layout, self._spares)
            names: list[str] = []
            for file in files:
                tensors = load_file(file)
                stage.check_tensors(list(tensors), [t.dtype for t in tensors.values()], [tuple(t.shape) for t in tensors.values()])
                stage.load_weights(tensors.items())
                names += tensors
            # Over all files: a checkpoint is often split across several.
            stage.check_complete(names)
            stage.commit()
            self._base_version += 1

    def update_weight_version(self, new_version: str) -> None:
        self.weight_version = new_version

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serve the adapter version at ``lora_path`` (a ``wt-lora://``
        reference or a directory) to requests naming ``lora_name``, as vLLM's
        ``/v1/load_lora_adapter`` with ``load_inplace`` (the name's previous
        version is replaced)."""
        with self._lock:
            self.adapters.load(lora_name, lora_path)

    def unload_lora_adapter(self, lora_name: str) -> None:
        with self._lock:
            self.adapters.unload(lora_name)

    def weight_info(self) -> dict[str, Any]:
        return {
            "weight_version": self.weight_version,
            "updates_completed": self.updates_completed,
            "version_history": list(self.version_history),
        }

    def weight_checksums(self) -> dict[str, Any]:
        with self._lock:
            return {
                "weight_version": self.weight_version,
                "checksums": module_checksums(self.model),
                "adapters": self.adapters.checksums(),
            }

    def shutdown(self) -> None:
        self.engine.shutdown()
