"""Weights & Biases: one W&B run per run directory, continued on resume."""

from __future__ import annotations

import pathlib
import uuid
from typing import Any

from paisoar_jax.config import RunConfig
from paisoar_jax.errors import UserError
from paisoar_jax.observe.trackers.common import (
    DEFAULT_PROJECT,
    first_line,
    git_commit,
    import_package,
    numeric,
)


class WandB:
    """A Weights & Biases run: the config (with the git commit), then each record."""

    replays = False  # W&B takes no step twice: a resumed run's logged steps are skipped

    def __init__(self, reporting: RunConfig, run_dir: pathlib.Path, settings: dict, resume_step=0):
        wandb = import_package("wandb", "wandb")
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        try:
            self.run = wandb.init(
                project=reporting.project or DEFAULT_PROJECT,
                name=reporting.display_name,
                id=run_id,
                resume="allow",  # a resumed run continues the same W&B run
                dir=str(run_dir),
                config=settings | {"git_commit": git_commit()},
                # Its own lines stay in <run.dir>/wandb/*/logs; the console is ours.
                settings=wandb.Settings(console="off", quiet=True),
            )
        except Exception as error:  # no login and no WANDB_MODE=offline, no network, ...
            raise UserError(
                f"run.trackers=wandb: W&B did not start ({first_line(error)}); "
                f"log in with `wandb login`, or set WANDB_MODE=offline"
            ) from None
        id_file.write_text(run_id + "\n")

    def log(self, record: dict[str, Any]) -> None:
        """The record's numeric fields at its step."""
        self.run.log(numeric(record), step=record["step"])

    def close(self) -> None:
        """Ends the run (an offline one is then complete on disk for `wandb sync`)."""
        self.run.finish()
