"""Reference receiver: vLLM's RL weight-sync routes around any torch module.

It runs the same worker engines vLLM loads through our plugin, behind the
same routes, payloads and status codes, so a trainer cannot tell it from a
vLLM server as far as weight sync goes. Use it to develop and test a training
setup without vLLM, in CI, and in the quickstart. What it does beyond vLLM
(checksums, version history, all-or-nothing rounds) is in ``core``.

Three ways to run it, a module each:

* Python (``http``): ``with Receiver(model) as r: url = r.start()``.
* CLI (``cli``): ``python -m wt_callbacks.receiver --model DIR`` (a
  transformers causal LM) or ``--module-factory pkg.module:function``.
* Ray (``ray_actor``): ``ray.remote(RayReceiver).remote(model_dir_or_module)``,
  with the methods vLLM's ``LLM`` actors expose.
"""

from wt_callbacks.receiver.cli import load_model, main
from wt_callbacks.receiver.core import COMPLETION_PAUSE_WAIT_S, ReceiverCore, _host_config  # noqa: F401 - tests build engines with it
from wt_callbacks.receiver.http import Receiver, build_app
from wt_callbacks.receiver.ray_actor import RayReceiver
from wt_callbacks.receiver.staging import StagedWeights

__all__ = [
    "COMPLETION_PAUSE_WAIT_S",
    "RayReceiver",
    "Receiver",
    "ReceiverCore",
    "StagedWeights",
    "build_app",
    "load_model",
    "main",
]
