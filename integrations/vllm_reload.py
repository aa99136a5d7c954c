"""Rounds through vLLM's layerwise reload that are exact, and never succeed on stale weights.

``ReloadGuard`` is what the plugin's engine adds around vLLM 0.32's layerwise
reload (``vllm_layerwise`` describes that reload and the hooks into it):

* the served-model state reload gets wrong, kept right per round: tied
  parameters, fused MoE kernels on CPU, live parameters
  (``vllm_reload_state``);
* **completeness**: before any byte moves, a round is traced on meta tensors
  through the model's own loader (``vllm_load_trace``); a round that would
  leave a checkpoint tensor unloaded, send a name the model drops, or trip a
  loader's check is refused, naming the tensor, with nothing changed on the
  server. At finish, vLLM's per-layer counters are compared with the trace
  of the served checkpoint: an incomplete layer gets its previous weights
  back and the round fails naming the first served parameter not updated.
  On a pipeline-parallel server each stage judges its own layers: the
  tensors of the others' it skips, as vLLM's loaders do, but a round that
  leaves one of them out it refuses too, so that the stages agree.
* **kept tensors** (the update's ``keep``): a round may leave out tensors
  the server keeps as it holds them. They are traced with the sent ones, so
  they count towards a complete round; a round that keeps part of what the
  server loads as one layer (a kept ``k_proj`` beside a sent ``q_proj`` in
  one fused ``qkv_proj``) is refused before any byte moves, since that
  layer's previous tensors cannot be fed back through its loader. A layer
  kept whole (and a tied layer whose partner is) keeps its previous weights
  at finish, as an unloaded layer does, without failing the round.

What a failure keeps: every previous weight, for a round refused before
streaming and for one cut mid-stream, since layers completed while an
update streams are processed only once all of its tensors have arrived
(``vllm_layerwise.processing_deferred``); with the trainer's
``all_or_nothing`` off, the layers a cut round completed were processed and
hold the new weights. A round found incomplete at finish keeps the previous
weights of the layers it did not complete, while the layers it did complete
hold the new ones (push again): by then the update had ended and its layers
were processed. The check before streaming refuses such a round whenever the
served checkpoint is local safetensors, so this is the case of a checkpoint
without them.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from wt_callbacks.integrations.vllm_layerwise import missing_reload_internals, reload_undone
from wt_callbacks.integrations.vllm_load_trace import Coverage, Meta, checkpoint_metas, shard_key, trace_load
from wt_callbacks.integrations.vllm_reload_state import LiveParameters, MoeKernelRebuild, TiedParameters

logger = logging.getLogger(__name__)


@dataclass
class Incomplete:
    """A served layer a round did not fully update."""

    layer_name: str
    param: str
    loaded: int
    expected: int
    shards: list[str] = field(default_factory=list)

    def message(self) -> str:
        served = f"{self.layer_name}.{self.param}"
        if self.loaded == 0:
            return f"served parameter {served!r} was not updated by this round"
        shards = f"; shards loaded: {', '.join(self.shards)}" if self.shards else ""
        return (
            f"served parameter {served!r} was only partly updated by this round "
            f"({self.loaded} of {self.expected} elements of {self.layer_name}{shards})"
        )


def _has_parameters(layer: torch.nn.Module) -> bool:
    return any(p is not None for p in layer._parameters.values())


def _declared_numel(layer: torch.nn.Module, info: Any) -> int:
    """Without a checkpoint trace: vLLM's count less the vocabulary padding
    ``VocabParallelEmbedding`` declares (its loader zero-fills those rows
    uncounted)."""
    total = int(info.load_numel_total or 0)
    indices, rows = getattr(layer, "shard_indices", None), getattr(layer, "num_embeddings_per_partition", 0)
    if indices is None or not rows:
        return total
    for p in layer._parameters.values():
        if p is not None and getattr(p, "output_dim", None) is not None and p.numel():
            total -= p.numel() - p.numel() // rows * indices.num_org_elements
    return total


class ReloadGuard:
    """Everything a round needs around vLLM's layerwise reload (see the module docstring).

    The engine calls ``start`` after ``initialize_layerwise_reload``,
    ``refusal`` before receiving, ``keep_incomplete`` before
    ``finalize_layerwise_reload`` and ``end`` after it; ``abandon`` after a
    failed receive has finalized.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, model_dir: str) -> None:
        missing = missing_reload_internals()
        if missing:
            import vllm

            raise RuntimeError(
                f"wt_callbacks' torch_dist engine cannot guard weight updates on vLLM {vllm.__version__}: "
                f"its reload internals {missing} are gone. Use the vLLM version wt_callbacks supports (0.32)"
            )
        # Imported here: a vLLM without it fails the engine's start, not a round.
        from vllm.model_executor.models.utils import is_pp_missing_parameter

        self._pp_missing = is_pp_missing_parameter
        self.model = model
        self.tied = TiedParameters(model)
        self.moe = MoeKernelRebuild(model, device)
        metas = checkpoint_metas(model_dir)
        self.coverage = Coverage(model, metas) if metas else None
        self.round_open = False
        self._live: LiveParameters | None = None
        self._accepted: dict[tuple[Any, ...], tuple[frozenset[str], frozenset[str] | None]] = {}
        self._kept_layers: frozenset[str] = frozenset()
        """The served layers the open round keeps whole, by name."""
        self.loaded_layers: frozenset[str] | None = None
        """The served layers the last accepted round loads, by name; ``None``
        where its trace could not tell for sure (no local safetensors
        checkpoint to call a round complete against, or a loader that reads
        values)."""
        logger.info(
            "torch_dist engine: tied parameters %s, %d MoE layers rebuilt per round on CPU, completeness "
            "%s", self.tied.describe(), len(self.moe.layers),
            f"checked against {len(metas)} checkpoint tensors" if self.coverage else
            "checked per layer only (the served checkpoint is not local safetensors)",
        )  # fmt: skip

    def start(self) -> None:
        self._live = LiveParameters(self.model)
        self._live.save()
        self.moe.start()
        self.round_open = True

    def refusal(
        self,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[list[int]],
        *,
        serving: bool = False,
        kept: tuple[list[str], list[torch.dtype], list[list[int]]] = ([], [], []),
    ) -> str | None:
        """Why a round announcing these tensors (and keeping ``kept``) must be
        refused before any byte moves, or ``None``. A round announcing what an
        accepted one announced is accepted without tracing again: loaders do
        not look at values. ``serving``: layerwise reload is not under way (a
        staged round), so a trace begins it and undoes it (``reload_undone``)."""
        metas = [(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes)]
        kept_metas = [(n, d, tuple(s)) for n, d, s in zip(*kept)]
        key = (tuple(metas), tuple(kept_metas))
        if key not in self._accepted:
            with reload_undone(self.model) if serving else contextlib.nullcontext():
                reason, layers = self._refusal(metas, kept_metas)
            if reason is not None:
                return reason
            self._accepted[key] = layers
        self._kept_layers, self.loaded_layers = self._accepted[key]
        return None

    def _refusal(self, metas: list[Meta], kept: list[Meta]) -> tuple[str | None, tuple[frozenset[str], frozenset[str] | None]]:
        """The refusal, the served layers the round keeps whole, and those it
        loads (``None`` unless the trace of a complete round says for sure)."""
        trace = trace_load(self.model, metas + kept)
        if kept and trace.error:
            reason = (
                f"the round keeps {len(kept)} tensors, and its load cannot be traced to check which layers they "
                f"are part of ({trace.error}): send every tensor (send_frozen: every_round)"
            )
            return reason, (frozenset(), None)
        kept_layers, reason = self._kept_layers_of(trace, [n for n, _, _ in metas], [n for n, _, _ in kept])
        reason = reason or self._traced_refusal(trace, metas + kept)
        loaded = None
        if not trace.error and self.coverage is not None:
            loaded = frozenset(t[0] for n, _, _ in metas for t in trace.targets.get(n, ()))
        return reason, (kept_layers, loaded)

    @staticmethod
    def _kept_layers_of(trace: Any, sent: list[str], kept: list[str]) -> tuple[frozenset[str], str | None]:
        """The served layers only kept tensors load into, or why the round
        must be refused: a layer both a kept and a sent tensor load into."""
        loaded_by = {t[0]: n for n in sent for t in trace.targets.get(n, ())}
        for name in kept:
            for target in trace.targets.get(name, ()):
                if target[0] in loaded_by:
                    return frozenset(), (
                        f"the round keeps {name!r} but sends {loaded_by[target[0]]!r}, which the served model "
                        f"loads into one layer ({target[0]}): a layer's tensors are sent together or kept together"
                    )
        return frozenset(t[0] for n in kept for t in trace.targets.get(n, ())), None

    def _traced_refusal(self, trace: Any, metas: list[Meta]) -> str | None:
        if trace.error and "meta" in trace.error:
            # A loader that reads values (quantization scales) cannot run on
            # meta tensors; the check at finish still guards the round.
            logger.warning("cannot trace this round's load on meta tensors (%s); checking at finish only", trace.error)
            return None
        if trace.error:
            return f"the served model's loader rejects {trace.failed_name!r}: {trace.error}"
        dropped = [
            n for n, _, _ in metas if not trace.targets.get(n) and not self._tied_name(n) and not self._other_stage(n)
        ]  # fmt: skip
        if dropped:
            more = f" (and {len(dropped) - 1} more)" if len(dropped) > 1 else ""
            return f"the served model has no parameter for {dropped[0]!r}{more}: vLLM would drop it silently"
        if self.coverage is None:
            return None
        for name, _, shape in metas:
            # vLLM's QKV/merged loaders narrow along the TP dimension before
            # copying: a tensor longer there than the served one is truncated.
            want = self.coverage.shapes.get(name)
            if want is not None and tuple(want) != tuple(shape):
                return f"{name!r} has shape {list(shape)}; the served checkpoint's is {list(want)}"
        sent = set().union(*trace.targets.values()) if trace.targets else set()
        missing = [(n, t) for n, t in self.coverage.needed.items() if not t <= sent]
        if not missing:
            return self._other_stages_refusal({n for n, _, _ in metas})
        name, targets = missing[0]
        served = sorted(
            f"{t[0]}.{t[1]}" + (" (" + ", ".join(f"{k}={v}" for k, v in t[2:]) + ")" if t[2:] else "")
            for t in targets - sent
        )
        more = f" (and {len(missing) - 1} more checkpoint tensors)" if len(missing) > 1 else ""
        return f"this round does not send checkpoint tensor {name!r}{more}, which the served model loads into {served[0]}"

    def _other_stages_refusal(self, sent: set[str]) -> str | None:
        """A round that leaves out a checkpoint tensor of another pipeline
        stage is refused on this stage too: that stage refuses it, and if
        this one took it the server's stages would serve different rounds."""
        assert self.coverage is not None
        left_out = [n for n in self.coverage.shapes if n not in sent and self._other_stage(n)]
        if not left_out:
            return None
        more = f" (and {len(left_out) - 1} more)" if len(left_out) > 1 else ""
        return (
            f"this round does not send checkpoint tensor {left_out[0]!r}{more}, which another pipeline stage "
            "of this server loads"
        )

    def _other_stage(self, name: str) -> bool:
        """``name`` belongs to a layer another pipeline stage serves: this
        stage holds a placeholder there (vLLM's ``PPMissingLayer``), and the
        model's loader skips its tensors on purpose. Every stage gets the
        whole round and loads its own layers; what "complete" means is the
        served checkpoint traced through this stage (``Coverage``)."""
        return self._pp_missing(name, self.model)

    def _tied_name(self, name: str) -> bool:
        """``name`` belongs to a tied layer, whose weights the model's loader
        skips on purpose (``lm_head.weight`` with tied embeddings)."""
        try:
            return self.tied.is_tied(self.model.get_submodule(name.rpartition(".")[0]))
        except AttributeError:
            return False

    def keep_incomplete(self) -> tuple[list[Incomplete], set[int]]:
        """Before finalize: the layers the round left incomplete (in model
        order), made to keep their previous weights, and the ids of the layers
        the round processed."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        processed: set[int] = set()
        rows = []
        for name, layer in self.model.named_modules():
            info = get_layerwise_info(layer)
            if not info.can_load() or info.load_numel > 0:
                processed.add(id(layer))
            if info.can_load() and _has_parameters(layer):
                rows.append((name, layer, info))
        incomplete = []
        kept = {id(layer) for name, layer, _ in rows if name in self._kept_layers}
        for name, layer, info in rows:
            expected = self.coverage.counts.get(id(layer), 0) if self.coverage else _declared_numel(layer, info)
            if info.load_numel >= expected:
                continue
            if info.load_numel == 0 and self.tied.is_tied(layer) and self.tied.partner_in(layer, processed):
                continue
            kept_whole = info.load_numel == 0 and (id(layer) in kept or self.tied.partner_in(layer, kept))
            if not kept_whole:  # a layer kept whole keeps its previous weights below, as the round said
                incomplete.append(self._describe(name, layer, info, expected))
            # Nothing buffered: finalize puts the old kernel tensors back unprocessed.
            info.loaded_weights.clear()
            info.load_numel = 0
            processed.discard(id(layer))
            if self._live is not None:
                self._live.restore({id(layer)})
        return incomplete, processed

    @staticmethod
    def _describe(name: str, layer: torch.nn.Module, info: Any, expected: int) -> Incomplete:
        per_param: dict[str, int] = {}
        shards: dict[str, set[str]] = {}
        for attr, args in info.loaded_weights:
            w = args.arguments.get("loaded_weight")
            per_param[attr] = per_param.get(attr, 0) + (w.numel() if isinstance(w, torch.Tensor) else 0)
            key = shard_key(args)
            if key:
                shards.setdefault(attr, set()).add(",".join(f"{k}={v}" for k, v in key))
        attrs = [a for a, p in layer._parameters.items() if p is not None]
        worst = min(attrs, key=lambda a: per_param.get(a, 0) / max(1, layer._parameters[a].numel()))
        return Incomplete(name, worst, int(info.load_numel), int(expected), sorted(shards.get(worst, ())))

    def processed_layers(self) -> set[int]:
        """Ids of the layers the round processed so far (before a failed
        receive finalizes)."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        return {id(m) for m in self.model.modules() if not get_layerwise_info(m).can_load()}

    def end(self, processed: set[int]) -> list[str]:
        """After finalize: MoE kernels and ties right again. Returns the tied
        layers processed again."""
        self.moe.finish()
        self.round_open = False
        self._kept_layers = frozenset()
        return self.tied.restore(processed)

    def abandon(self, processed: set[int]) -> None:
        """After a failed receive was finalized: layers it did not process
        get their live parameters' previous values back."""
        if self._live is not None:
            self._live.restore({id(m) for m in self.model.modules()} - processed)
        self.end(processed)
