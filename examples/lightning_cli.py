"""LightningCLI entry point: the whole sync setup lives in a YAML file.

    .venv/bin/python examples/lightning_cli.py fit --config examples/lightning_cli.yaml

``WeightSyncCallback`` is listed under ``trainer.callbacks`` and the model's
``weight_sync`` init argument carries the section; arguments given to the
callback in the YAML override the section's keys. With no ``servers`` (nor
``ray_actors``) in the section, as shipped, the script starts the embedded
reference receiver, as the quickstart does; set ``servers`` to sync into
running servers (``.venv/bin/python -m wt_callbacks.receiver --model DIR`` or vLLM).
"""

from lightning.pytorch.cli import LightningCLI

# The quickstart sits next to this script, whose directory Python puts on the import path.
from lightning_quickstart import ReversalLM

from wt_callbacks.demos import toy_task


class SyncCLI(LightningCLI):
    """Starts the embedded receiver before ``fit`` when the section names no server."""

    receiver = None

    def before_fit(self) -> None:
        section = self.model.hparams.weight_sync
        if section.get("servers") or section.get("ray_actors"):
            return
        self.receiver = toy_task.embedded_receiver()
        section["servers"] = [self.receiver.url]
        print(f"no servers in weight_sync: embedded reference receiver serving on {self.receiver.url}")

    def after_fit(self) -> None:
        if self.receiver is not None:
            print(f"versions served: {self.receiver.core.version_history}")
            self.receiver.stop()


def main() -> None:
    SyncCLI(ReversalLM, save_config_callback=None)


if __name__ == "__main__":
    main()
