"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases and MLflow.

`run.trackers` names them (TensorBoard by default). Each gets every numeric field of every
metrics.jsonl record (the train records and the eval's) at its step; W&B and MLflow also
get the resolved config and the git commit of the code that started the run (the working
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

import os
import pathlib
import subprocess
import time
import uuid
from typing import Any

from flax import traverse_util

from paisoar_jax.config import Config, to_dict
from paisoar_jax.errors import UserError

DEFAULT_PROJECT = "paisoar_jax"


def open_trackers(
    config: Config,
    run_dir: pathlib.Path,
    resume_step: int = 0,
    optimizer: dict[str, Any] | None = None,
) -> list[Any]:
    """The trackers `config.run` names, each ready to `log(record)` and `close()`.

    `resume_step`: the checkpoint's step a resumed run starts from; `optimizer`: what an
    optimizer given to fit is (optim.describe_given), recorded in place of `optim`.
    """
    settings = to_dict(config)
    if optimizer is not None:
        settings["optim"] = optimizer
    kinds = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}
    return [
        kinds[name](config, run_dir, settings, resume_step) for name in config.run.active_trackers
    ]


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields but its step (booleans and text left out)."""
    return {
        key: value
        for key, value in record.items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    }


def git_commit(directory: pathlib.Path | None = None) -> str | None:
    """The commit checked out in `directory`'s repository (the working directory's), or None."""
    try:
        found = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() if found.returncode == 0 else None


def _import(name: str, package: str):
    """The tracker's package, or one line naming the extra that installs it."""
    try:
        return __import__(package)
    except ImportError:
        raise UserError(
            f'run.trackers={name} needs the {name} package: pip install "paisoar-jax[{name}]"'
        ) from None


class TensorBoard:
    """Scalars in <run.dir>/tensorboard (tensorboardX)."""

    replays = True  # a resumed run's steps past its checkpoint replace the old ones

    def __init__(self, config: Config | None, run_dir: pathlib.Path, settings=None, resume_step=0):
        from tensorboardX import SummaryWriter  # imported late: only process 0 needs it

        purge_step = resume_step + 1 if resume_step else None  # hides the old steps after it
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step)

    def log(self, record: dict[str, Any]) -> None:
        """Each numeric field as a scalar at the record's step."""
        for key, value in numeric(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        """Flushes and closes the event file."""
        self.writer.close()


class WandB:
    """A Weights & Biases run: the config (with the git commit), then each record."""

    replays = False  # W&B takes no step twice: a resumed run's logged steps are skipped

    def __init__(self, config: Config, run_dir: pathlib.Path, settings: dict, resume_step=0):
        wandb = _import("wandb", "wandb")
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        try:
            self.run = wandb.init(
                project=config.run.project or DEFAULT_PROJECT,
                name=config.run.display_name,
                id=run_id,
                resume="allow",  # a resumed run continues the same W&B run
                dir=str(run_dir),
                config=settings | {"git_commit": git_commit()},
                # Its own lines stay in <run.dir>/wandb/*/logs; the console is ours.
                settings=wandb.Settings(console="off", quiet=True),
            )
        except Exception as error:  # no login and no WANDB_MODE=offline, no network, ...
            raise UserError(
                f"run.trackers=wandb: W&B did not start ({_first_line(error)}); "
                f"log in with `wandb login`, or set WANDB_MODE=offline"
            ) from None
        id_file.write_text(run_id + "\n")

    def log(self, record: dict[str, Any]) -> None:
        """The record's numeric fields at its step."""
        self.run.log(numeric(record), step=record["step"])

    def close(self) -> None:
        """Ends the run (an offline one is then complete on disk for `wandb sync`)."""
        self.run.finish()


class MLflow:
    """An MLflow run in an experiment named run.project: params, a commit tag, metrics."""

    replays = False  # a metric logged twice at a step would show twice: skipped instead

    def __init__(self, config: Config, run_dir: pathlib.Path, settings: dict, resume_step=0):
        mlflow = _import("mlflow", "mlflow")
        uri = config.run.tracking_uri
        if not uri:
            uri = (run_dir / "mlruns").absolute().as_uri()
            # MLflow 3 keeps its file store working but asks for this to use it: a store
            # with no server and no database is what a run directory should hold.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.metric = mlflow.entities.Metric
        try:
            self._start(mlflow, config, settings, run_dir, uri)
        except Exception as error:  # a server that does not answer, a bad URI, ...
            raise UserError(
                f"run.trackers=mlflow: MLflow at {uri} did not start a run "
                f"({_first_line(error, 300)}); check run.tracking_uri"
            ) from None

    def _start(self, mlflow, config: Config, settings: dict, run_dir: pathlib.Path, uri: str):
        """Opens the run: the one this run directory started, or a new one."""
        from mlflow.entities import Param

        self.client = mlflow.MlflowClient(tracking_uri=uri)
        id_file = run_dir / "mlflow_run_id"
        if id_file.is_file():  # a resumed run logs on into the run it started
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = config.run.project or DEFAULT_PROJECT
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        commit = git_commit()
        tags = {"mlflow.source.git.commit": commit} if commit else {}
        run_name = config.run.display_name
        self.run_id = self.client.create_run(experiment, run_name=run_name, tags=tags)
        self.run_id = self.run_id.info.run_id
        flat = traverse_util.flatten_dict(settings, sep=".")
        params = [Param(key, str(value)[:6000]) for key, value in flat.items()]
        for start in range(0, len(params), 100):  # MLflow takes 100 params a batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        id_file.write_text(self.run_id + "\n")

    def log(self, record: dict[str, Any]) -> None:
        """The record's numeric fields as metrics at its step."""
        now = int(time.time() * 1000)
        metrics = [
            self.metric(key, float(value), now, record["step"])
            for key, value in numeric(record).items()
        ]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        """Marks the run finished."""
        self.client.set_terminated(self.run_id)


def _first_line(error: Exception, limit: int | None = None) -> str:
    """`Kind: the first line of its message` (a tracker's own message leads with its cause)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:limit] if text else ''}"
