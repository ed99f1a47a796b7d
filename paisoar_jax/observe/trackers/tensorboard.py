"""TensorBoard: scalars in <run.dir>/tensorboard, through tensorboardX."""

from __future__ import annotations

import logging
import pathlib
from typing import Any

from paisoar_jax.config import RunConfig
from paisoar_jax.observe.trackers.common import numeric


class TensorBoard:
    """Scalars in <run.dir>/tensorboard (tensorboardX)."""

    replays = True  # a resumed run's steps past its checkpoint replace the old ones

    def __init__(
        self, reporting: RunConfig | None, run_dir: pathlib.Path, settings=None, resume_step=0
    ):
        from tensorboardX import SummaryWriter  # imported late: only process 0 needs it

        # A skipped fp16 step's grad_norm and a diverged loss are logged as NaN on purpose:
        # tensorboardX would warn of each on stderr.
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        purge_step = resume_step + 1 if resume_step else None  # hides the old steps after it
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step)

    def log(self, record: dict[str, Any]) -> None:
        """Each numeric field as a scalar at the record's step."""
        for key, value in numeric(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        """Flushes and closes the event file."""
        self.writer.close()
