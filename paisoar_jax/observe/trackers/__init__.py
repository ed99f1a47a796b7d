"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases and MLflow.

`run.trackers` names them (TensorBoard by default); `TRACKERS` maps each name to its
class, one module each (tensorboard.py, wandb.py, mlflow.py; what they share: common.py).
A tracker is built as `Tracker(reporting, run_dir, settings, resume_step)` and has
`log(record)`, `close()` and `replays` (whether a resumed run's steps past its checkpoint
are logged anew). Each gets every numeric field of every metrics.jsonl record (the train
records and the eval's) at its step; W&B and MLflow also get the resolved config and the
git commit of the code that started the run (the working
directory's repository, when it is one). Only process 0 writes (metrics.MetricsWriter).

A resumed run continues its tracker run: the W&B run id and the MLflow run id are kept in
the run directory (`wandb_run_id`, `mlflow_run_id`), and the steps the interrupted run had
logged past its checkpoint (run again, to the same values) are not logged twice: W&B and
MLflow skip them, TensorBoard hides its old events after the checkpoint's step
(tensorboardX's purge_step) and takes them anew.

The name a tracker shows is run.dir's last folder when run.dir is set, else run.name; with
an optimizer given to fit, the config it records holds that optimizer's description in
place of the unused optim section.

W&B runs online when it is logged in, offline with `WANDB_MODE=offline` (no network; `wandb
sync` uploads later). MLflow writes to `run.tracking_uri`, by default a file store in
`<run.dir>/mlruns`. A tracker whose package is missing is one line naming the extra.
"""

from __future__ import annotations

import pathlib
from typing import Any

from paisoar_jax.config import RunConfig
from paisoar_jax.observe.trackers.common import git_commit, numeric
from paisoar_jax.observe.trackers.mlflow import MLflow
from paisoar_jax.observe.trackers.tensorboard import TensorBoard
from paisoar_jax.observe.trackers.wandb import WandB

__all__ = ["TRACKERS", "MLflow", "TensorBoard", "WandB", "git_commit", "numeric", "open_trackers"]

# run.trackers' names (config/run.py lists the same, which it checks the config against).
TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def open_trackers(
    reporting: RunConfig,
    record: dict[str, Any],
    run_dir: pathlib.Path,
    resume_step: int = 0,
    optimizer: dict[str, Any] | None = None,
) -> list[Any]:
    """The trackers the `run` section (`reporting`) names, each ready to `log` and `close()`.

    `record`: the resolved config as sections, which W&B and MLflow keep; `resume_step`:
    the checkpoint's step a resumed run starts from; `optimizer`: what an optimizer given
    to fit is (optim.describe_given), recorded in place of `optim`.
    """
    settings = dict(record)
    if optimizer is not None:
        settings["optim"] = optimizer
    return [
        TRACKERS[name](reporting, run_dir, settings, resume_step)
        for name in reporting.active_trackers
    ]
