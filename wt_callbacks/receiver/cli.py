"""``python -m wt_callbacks.receiver``: build the served model and serve it over HTTP."""

import argparse
import importlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence

import torch

from wt_callbacks.receiver.http import Receiver
from wt_callbacks.transfer.base import dtype_from_name

logger = logging.getLogger(__name__)


def port_number(text: str) -> int:
    """``--port``: a TCP port number, 0 to 65535."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to 65535; 0 picks a free port)")
    return int(text)


def load_model(model: str | None = None, module_factory: str | None = None, dtype: str | None = None) -> torch.nn.Module:
    """Build the served model from a transformers directory or a factory path.

    ``ValueError`` naming the flag for what the caller got wrong (the CLI
    answers it as a usage error); the factory's own errors propagate."""
    if (model is None) == (module_factory is None):
        raise ValueError("give exactly one of --model DIR or --module-factory pkg.module:function")
    torch_dtype = dtype_from_name(dtype, key="--dtype") if dtype else None
    if torch_dtype is not None and not torch_dtype.is_floating_point:
        raise ValueError(f"--dtype={dtype!r}: weights are held in a floating-point dtype such as 'bfloat16'")
    if model is not None:
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": torch_dtype} if torch_dtype is not None else {}
        try:
            module = AutoModelForCausalLM.from_pretrained(model, **kwargs)
        except OSError as e:
            raise ValueError(f"--model {model!r} is not a transformers model directory: {e}") from e
    else:
        module_path, _, attr = module_factory.partition(":")
        if not attr:
            raise ValueError(f"--module-factory {module_factory!r} must look like 'pkg.module:function'")
        try:
            factory: Callable[[], torch.nn.Module] = getattr(importlib.import_module(module_path), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--module-factory {module_factory!r}: {e}") from e
        module = factory()
        if torch_dtype is not None:
            module = module.to(torch_dtype)
    return module.eval()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m wt_callbacks.receiver",
        description="Serve a model on vLLM's RL weight-sync routes (reference receiver).",
    )
    parser.add_argument("--model", help="transformers causal-LM directory (AutoModelForCausalLM)")
    parser.add_argument("--module-factory", help="pkg.module:function returning a torch.nn.Module")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000, help="0 picks a free port")
    parser.add_argument("--backend", default="torch_dist")
    parser.add_argument("--dtype", default=None, help="dtype to hold the weights in, e.g. bfloat16")
    parser.add_argument(
        "--api-key", default=None,
        help="token every route but /health requires (default: VLLM_API_KEY from the environment; none: no check)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        model = load_model(args.model, args.module_factory, args.dtype)
    except ValueError as e:
        parser.error(str(e))
    tokenizer = None
    if args.model is not None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError) as e:
            logger.warning("no tokenizer in %s (%s): /v1/completions disabled", args.model, e)
    try:
        receiver = Receiver(
            model, backend=args.backend, tokenizer=tokenizer, model_name=args.model or args.module_factory,
            api_key=args.api_key,
        )  # fmt: skip
    except ValueError as e:  # checked here, not as argparse choices: a factory module may register its backend
        parser.error(f"--backend: {e}")
    try:
        url = receiver.start(args.host, args.port)
    except OSError as e:  # names --host or --port
        parser.error(str(e))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Tests and scripts read this line to learn the port.
    print(f"wt_callbacks receiver serving on {url}", flush=True)
    stop.wait()
    receiver.stop()
    sys.exit(0)
