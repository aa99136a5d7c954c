"""LightningCLI entry point: the whole sync setup lives in a YAML file.

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml

``WeightSyncCallback`` is listed under ``trainer.callbacks`` and the model's
``weight_sync`` init argument carries the section; arguments given to the
callback in the YAML override the section's keys. Point ``servers`` at a
running server (``python -m wt_callbacks.receiver --model DIR`` or vLLM).
"""

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_quickstart import ReversalLM  # noqa: E402


def main() -> None:
    LightningCLI(ReversalLM, save_config_callback=None)


if __name__ == "__main__":
    main()
