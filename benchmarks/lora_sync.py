"""LoRA: bytes and seconds per round, adapter vs merge vs full fine-tune, one model, one run.

The model has the shape of Qwen2.5-0.5B (24 layers, hidden 896, MLP 4864,
vocabulary 151936, tied embeddings: 494M parameters) with a LoRA of rank 16
on every linear layer. Three ways to keep one server serving the policy,
each in its own ``WeightSync`` with a bf16 wire (the default server here is
fp32 vLLM with ``--enable-lora``, started from the base checkpoint):

* ``adapter`` (``lora: adapter``): the adapter alone; the server writes it
  and loads it as a LoRA (rounds include that load);
* ``merge`` (``lora: merge``): the base checkpoint's tensors with the
  adapter merged in on the fly; after the connection's first round, the
  frozen tensors no adapter touches (the embedding, the norms) are left as
  the server holds them (``send_frozen: once``, the default);
* ``merge-every-round``: the same with ``send_frozen: every_round``;
* ``full``: the same shape without PEFT (a full fine-tune), every tensor.

Rounds are timed as ``WeightSync.sync`` times them (pause, send, finish,
resume; for the adapter, its load), after one warm-up round per mode; the
trainable weights move between rounds. One more round of each mode, not
timed, is verified (served logprobs against the trainer's model, bf16
tolerance).
Also reported: each mode's first round (the connection's), in bytes.

    python benchmarks/lora_sync.py --out benchmarks/results/lora_sync.json     # vLLM (WT_VLLM_PYTHON)
    python benchmarks/lora_sync.py --target receiver --layers 1 --hidden 64 --intermediate 128 --vocab 1000 --rounds 1 --out /tmp/l.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from wt_callbacks.config import SyncConfig
from wt_callbacks.demos import toy_task
from wt_callbacks.demos.receiver_process import start_receiver
from wt_callbacks.demos.vllm_server import find_vllm_python, start_vllm_server
from wt_callbacks.sync import WeightSync

from harness import CpuLoadMeter

MODES = ("adapter", "merge", "merge-every-round", "full")
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).float().eval()


def trainer_model(mode: str, args: argparse.Namespace) -> torch.nn.Module:
    model = base_model(args)
    if mode == "full":
        return model
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=ALL_LINEAR))


def move(model: torch.nn.Module, generator: torch.Generator) -> None:
    """What a training step does to the trainable weights, roughly: every one moves."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * 1e-3)


def run_mode(mode: str, url: str, args: argparse.Namespace, pids: list[int]) -> dict[str, Any]:
    model = trainer_model(mode, args)
    keys: dict[str, Any] = {"servers": [url], "dtype": "bfloat16", "timeout_s": args.timeout, "verify_tolerance": 0.1}
    if mode == "adapter":
        keys.update(lora="adapter", lora_name="policy")
    if mode == "merge-every-round":
        keys.update(send_frozen="every_round")
    ws = WeightSync(SyncConfig(**keys))
    ws.setup(model)
    generator = torch.Generator().manual_seed(1)
    rows = []
    try:
        # Round 0 warms up (connect, first allocations, first load); the
        # last one is verified, which its time would include: neither is timed.
        for step in range(args.rounds + 2):
            move(model, generator)
            with CpuLoadMeter(*pids) as load:
                result = ws.sync(step, verify=step == args.rounds + 1)
            if step == 0:
                first_round_bytes = result.bytes
            if 0 < step <= args.rounds:
                rows.append({"seconds": result.seconds, "gather_s": result.gather_seconds, "load": load.other_cores})
        return {
            "mode": mode,
            "first_round_bytes": first_round_bytes,
            "bytes_per_round": result.bytes,
            "median_s": statistics.median(r["seconds"] for r in rows),
            "median_gather_s": statistics.median(r["gather_s"] for r in rows),
            "other_load": max(r["load"] for r in rows),
            "verify_max_logprob_diff": result.verify_max_logprob_diff,
            "rounds": rows,
        }
    finally:
        ws.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["vllm", "receiver"], default="vllm")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    base = base_model(args)
    params = sum(p.numel() for p in base.parameters())
    base.save_pretrained(work / "base")
    toy_task.build_tokenizer().save_pretrained(work / "base")
    del base
    if args.target == "vllm":
        python, reason = find_vllm_python()
        if python is None:
            print(reason, file=sys.stderr)
            return 2
        server = start_vllm_server(
            python, work / "base", work / "vllm.log", timeout_s=args.timeout,
            extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
            extra_args=["--enable-lora", "--max-lora-rank", str(args.rank), "--max-loras", "2"],
        )  # fmt: skip
        url, pids, stop = server.url, [server.proc.pid], server.stop
    else:
        receiver = start_receiver("", extra_args=("--model", str(work / "base")), timeout_s=args.timeout, env={"WT_LORA_DIR": str(work / "adapters")})
        url, pids, stop = receiver.url, [receiver.proc.pid], receiver.stop
    started = time.time()
    try:
        rows = [run_mode(mode, url, args, pids) for mode in MODES]
    finally:
        stop()
        shutil.rmtree(work, ignore_errors=True)
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "rank")}
    result = {"target": args.target, "params": params, "shape": shape, "wire": "bfloat16", "rows": rows, "seconds": time.time() - started}
    args.out.write_text(json.dumps(result, indent=2))
    full = next(r for r in rows if r["mode"] == "full")
    lines = [
        f"LoRA sync into {args.target}, {params / 1e6:.0f}M parameters, r={args.rank} on every linear layer, bf16 wire",
        "",
        "| mode | MB first round | MB per round | x fewer bytes than full | s per round (median) | gather s | verified max logprob diff | other load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['first_round_bytes'] / 1e6:.1f} | {r['bytes_per_round'] / 1e6:.1f} | "
            f"{full['bytes_per_round'] / r['bytes_per_round']:.1f} | {r['median_s']:.3f} | {r['median_gather_s']:.3f} | "
            f"{r['verify_max_logprob_diff']:.1e} | {r['other_load']:.2f} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
