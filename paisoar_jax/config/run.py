"""The `run` section: where a run writes, what it shows, and the trackers it reports to."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from paisoar_jax.errors import UserError

TRACKERS = ("tensorboard", "wandb", "mlflow")


@dataclass(frozen=True)
class RunConfig:
    """Where the run writes and what it shows."""

    name: str = "default"  # the run's name: runs/<name>, and in the trackers
    dir: str = ""  # empty: runs/<name>
    # where metrics.jsonl's records also go (process 0 only): tensorboard, wandb, mlflow
    trackers: tuple[str, ...] = ("tensorboard",)
    tensorboard: bool = True  # false: no TensorBoard, whatever run.trackers says
    project: str = ""  # the W&B project and MLflow experiment; empty: paisoar_jax
    tracking_uri: str = ""  # MLflow's tracking URI; empty: a file store in <run.dir>/mlruns
    progress: bool = True  # tqdm progress bar

    def __post_init__(self):
        for name in self.trackers:
            if name not in TRACKERS:
                raise UserError(f"run.trackers: {name!r} is not one of {', '.join(TRACKERS)}")
        if len(set(self.trackers)) < len(self.trackers):
            raise UserError(f"run.trackers names a tracker twice: {list(self.trackers)}")

    @property
    def active_trackers(self) -> tuple[str, ...]:
        """The trackers this run writes to (run.tensorboard=false removes TensorBoard)."""
        return tuple(name for name in self.trackers if self.tensorboard or name != "tensorboard")

    @property
    def display_name(self) -> str:
        """The run's name in the trackers: run.dir's last folder when run.dir is set."""
        return (pathlib.Path(self.dir).absolute().name if self.dir else "") or self.name
