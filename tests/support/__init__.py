"""Test-only support: the apps the multi-process tests launch, trainer-side helpers,
and a fake ``vllm`` package. Helpers examples and benchmarks share live in
``wt_callbacks.demos``."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""Where the tests run scripts, examples and ``python -m tests.support...`` apps from."""
