"""Fake vllm (see ../README.md). The release it imitates is chosen by the test
(``WT_FAKE_VLLM_VERSION``): the trainer-side ``WeightSource`` changed between
0.32 and 0.33."""

import os

__version__ = os.environ.get("WT_FAKE_VLLM_VERSION", "0.32.0")
V033 = __version__.startswith("0.33.")
