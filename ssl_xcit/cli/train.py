"""``ssl-xcit fit|validate|test|predict -c CONFIG.yaml``: LightningCLI over any LightningModule/DataModule.

Subclass mode: a config names its model and data classes (``class_path``), so the DINO recipes
(``ssl_xcit.dino.module.DINO`` + ``ssl_xcit.data.DINODataModule``) and the linear-probe configs of
``eval/`` run through the same command. Every key is checked by jsonargparse: a typo is an error that names it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI


class SSLXCiTCLI(LightningCLI):
    """LightningCLI with the project's defaults (seed 0, config saved next to the logs, overwritten)."""


def main(argv: Sequence[str] | None = None) -> LightningCLI:
    """Run the CLI on ``argv`` (the subcommand first, e.g. ``["fit", "-c", "recipes/quickstart.yaml"]``;
    default ``sys.argv[1:]``) and return it; ``cli.trainer`` and ``cli.model`` hold the results."""
    with warnings.catch_warnings():
        # The dispatcher passes argv explicitly (it equals sys.argv[1:] from the console); not a mistake here.
        warnings.filterwarnings("ignore", message=".*not recommended to provide both args and command line")
        return SSLXCiTCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            seed_everything_default=0,
            save_config_kwargs={"overwrite": True},
            args=None if argv is None else list(argv),
            run=True,
        )
