"""LightningCLI entry point: the whole sync setup lives in a YAML file.

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml

``WeightSyncCallback`` is listed under ``trainer.callbacks`` and the model's
``weight_sync`` init argument carries the section; arguments given to the
callback in the YAML override the section's keys. Point ``servers`` at a
running server (``python -m wt_callbacks.receiver --model DIR`` or vLLM).
"""

from lightning.pytorch.cli import LightningCLI

# The quickstart sits next to this script, whose directory Python puts on the import path.
from lightning_quickstart import ReversalLM


def main() -> None:
    LightningCLI(ReversalLM, save_config_callback=None)


if __name__ == "__main__":
    main()
