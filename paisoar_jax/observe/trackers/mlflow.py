"""MLflow: one run per run directory in the experiment run.project, continued on resume."""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

from flax import traverse_util

from paisoar_jax.config import RunConfig
from paisoar_jax.errors import UserError
from paisoar_jax.observe.trackers.common import (
    DEFAULT_PROJECT,
    first_line,
    git_commit,
    import_package,
    numeric,
)


class MLflow:
    """An MLflow run in an experiment named run.project: params, a commit tag, metrics."""

    replays = False  # a metric logged twice at a step would show twice: skipped instead

    def __init__(self, reporting: RunConfig, run_dir: pathlib.Path, settings: dict, resume_step=0):
        mlflow = import_package("mlflow", "mlflow")
        uri = reporting.tracking_uri
        if not uri:
            uri = (run_dir / "mlruns").absolute().as_uri()
            # MLflow 3 keeps its file store working but asks for this to use it: a store
            # with no server and no database is what a run directory should hold.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.metric = mlflow.entities.Metric
        try:
            self._start(mlflow, reporting, settings, run_dir, uri)
        except Exception as error:  # a server that does not answer, a bad URI, ...
            raise UserError(
                f"run.trackers=mlflow: MLflow at {uri} did not start a run "
                f"({first_line(error, 300)}); check run.tracking_uri"
            ) from None

    def _start(self, mlflow, reporting: RunConfig, settings: dict, run_dir: pathlib.Path, uri: str):
        """Opens the run: the one this run directory started, or a new one."""
        from mlflow.entities import Param

        self.client = mlflow.MlflowClient(tracking_uri=uri)
        id_file = run_dir / "mlflow_run_id"
        if id_file.is_file():  # a resumed run logs on into the run it started
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = reporting.project or DEFAULT_PROJECT
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        commit = git_commit()
        tags = {"mlflow.source.git.commit": commit} if commit else {}
        run_name = reporting.display_name
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
