"""What sending the checkpoint format costs per round, next to the round.

A transformers-5 MoE keeps its experts packed in memory; ``ModuleSource``
splits them into the per-expert tensors the checkpoint (and vLLM) names, a
group at a time. This measures, interleaved in one run on a Qwen3-MoE of the
given size:

* iterating the source as sent (conversion included) against iterating
  ``named_parameters()`` (what was sent before, in the wrong format);
* a whole round into a reference receiver process, which converts back into
  its packed layout at commit.

Rows: seconds (median), the conversion's share of the round, tensors sent.

    python benchmarks/checkpoint_format_cost.py --experts 64 --layers 8 --out benchmarks/results/checkpoint_format.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from wt_callbacks.checksums import module_checksums
from wt_callbacks.demos.receiver_process import receiver_checksums, start_receiver
from wt_callbacks.demos.tiny_lms import MOE_SHAPE_ENV, sized_qwen3_moe
from wt_callbacks.transfer import HTTPVLLMWeightSyncClient, ModuleSource

from harness import trainer_engine


def timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    model = sized_qwen3_moe(args.layers, args.experts, args.hidden, seed=0).eval()
    params = sum(p.numel() for p in model.parameters())
    source = ModuleSource(model)
    sent = len(source.metadata())
    receiver = start_receiver(
        "wt_callbacks.demos.tiny_lms:sized_qwen3_moe_receiver",
        env={MOE_SHAPE_ENV: f"{args.layers},{args.experts},{args.hidden}"},
        timeout_s=args.timeout,
    )
    client = HTTPVLLMWeightSyncClient(receiver.url, timeout=args.timeout)
    engine = trainer_engine(client, source, args.timeout)
    rows: dict[str, list[float]] = {"named_parameters": [], "checkpoint format": [], "round": []}
    try:
        for i in range(args.rounds):  # interleaved: the machine is shared
            rows["named_parameters"].append(timed(lambda: [t for _, t in model.named_parameters()]))
            rows["checkpoint format"].append(timed(lambda: [t for _, t in source]))
            rows["round"].append(timed(lambda: engine.send_weights(f"v{i}")))
        exact = receiver_checksums(receiver.url) == module_checksums(model)
    finally:
        engine.shutdown()
        client.close()
        receiver.stop()
    medians = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "params": params, "in_memory_tensors": len(list(model.parameters())), "sent_tensors": sent,
        "seconds": medians, "conversion_share_of_round": medians["checkpoint format"] / medians["round"],
        "receiver_checksums_equal": exact,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(
        f"Qwen3-MoE {params / 1e6:.0f}M params, {result['in_memory_tensors']} tensors in memory -> {sent} sent\n"
        f"| what | s (median of {args.rounds}) |\n|---|---:|\n"
        + "".join(f"| {k} | {v:.4f} |\n" for k, v in medians.items())
        + f"conversion = {100 * result['conversion_share_of_round']:.1f}% of the round; receiver checksums equal: {exact}"
    )
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
