"""Trackers (paisoar_jax/observe/trackers/): W&B offline and an MLflow file store hold what
metrics.jsonl holds; a resumed run continues the same tracker runs; bad input is one line."""

import json
import shutil
import subprocess
import sys

import optax
import pytest
from conftest import TINY, run_records
from wandb.proto.wandb_internal_pb2 import Record

import paisoar_jax
from paisoar_jax.config import load_config
from paisoar_jax.errors import UserError
from paisoar_jax.observe.trackers import numeric

SETTINGS = [*TINY, "model.layers=1", "train.log_every=1", "train.eval_every=2"]
SETTINGS += ["optim.schedule=constant", "optim.warmup_steps=0", "checkpoint.every=2"]
SETTINGS += ["run.trackers=[wandb,mlflow]"]


def wandb_records(run_dir):
    """(history rows by step, the run's config) from the offline run's .wandb file.

    The file is a LevelDB-style log of W&B's own protobuf Records (32 KiB blocks, each
    record a 7-byte header: crc, length, kind); W&B itself reads it when it syncs.
    """
    rows, config, logged = {}, {}, []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, position, pending, block = path.read_bytes(), 7, b"", 32768
        assert data[:4] == b":W&B"
        while position + 7 <= len(data):
            if block - position % block < 7:  # a block's tail too short for a header
                position += block - position % block
                continue
            length = int.from_bytes(data[position + 4 : position + 6], "little")
            kind = data[position + 6]
            pending += data[position + 7 : position + 7 + length]
            position += 7 + length
            if kind not in (1, 4):  # not FULL or LAST: the record goes on
                continue
            record, pending = Record.FromString(pending), b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                row = {
                    item.key or ".".join(item.nested_key): json.loads(item.value_json)
                    for item in items
                }
                rows[record.history.step.num] = row
                logged.append(record.history.step.num)
            elif record.WhichOneof("record_type") == "run":
                config |= {
                    item.key: json.loads(item.value_json) for item in record.run.config.update
                }
    assert len(logged) == len(set(logged)), f"W&B got a step twice: {sorted(logged)}"
    return rows, config


def mlflow_history(run_dir):
    """{metric: {step: value}} and the run's params and tags, from the file store."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").absolute().as_uri())
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    history = {}
    for key in run.data.metrics:
        points = client.get_metric_history(run.info.run_id, key)
        history[key] = {point.step: point.value for point in points}
        assert len(points) == len(history[key]), f"MLflow got a step of {key} twice"
    return history, run.data.params, run.data.tags | {"run_name": run.info.run_name}


def test_wandb_offline_and_mlflow_hold_metrics_jsonl_and_resume_into_the_same_runs(
    tmp_path, monkeypatch
):
    """... each step once, though the resumed run redoes steps the first had logged; the
    run named after run.dir; the optimizer given to fit recorded, not the optim section."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "exp7"
    optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=2e-3, weight_decay=0.0)
    paisoar_jax.fit(None, [*SETTINGS, "train.steps=4", f"run.dir={run_dir}"], optimizer=optimizer)
    first_mlflow_run = (run_dir / "mlflow_run_id").read_text()
    first = {record["step"]: numeric(record) for record in run_records(run_dir)}
    # As if killed after logging step 4 but before its save: the resumed run redoes 3 and 4.
    shutil.rmtree(run_dir / "checkpoints" / "4")
    paisoar_jax.fit(None, [*SETTINGS, "train.steps=6", f"run.dir={run_dir}"], optimizer=optimizer)
    assert (run_dir / "mlflow_run_id").read_text() == first_mlflow_run
    records = {record["step"]: numeric(record) for record in run_records(run_dir)}
    assert sorted(records) == [1, 2, 3, 4, 5, 6] and "eval_loss" in records[6]
    for step in (3, 4):  # redone to the same values; the trackers keep the first run's
        assert records[step]["loss"] == first[step]["loss"]
    records |= {step: first[step] for step in (3, 4)}

    rows, config = wandb_records(run_dir)
    history, params, tags = mlflow_history(run_dir)
    for step, fields in records.items():
        assert {key: rows[step][key] for key in fields} == pytest.approx(fields, rel=1e-6), step
        for key, value in fields.items():
            assert history[key][step] == pytest.approx(value, rel=1e-6), (key, step)
    # The config and the commit of the code that ran (this repository's checkout).
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    assert config["train"]["steps"] in (4, 6)
    assert params["train.global_batch"] == "16" and params["run.trackers"] == str(
        ("wandb", "mlflow")
    )
    assert tags["run_name"] == "exp7"
    for recorded in (config["optim"], {"hyperparams": {"learning_rate": 2e-3}}):
        assert recorded["hyperparams"]["learning_rate"] == pytest.approx(2e-3)
    assert config["optim"]["transforms"].startswith("InjectStatefulHyperparams, ScaleByAdam")
    assert params["optim.clip_norm"] == "0.0" and "optim.lr" not in params
    if commit.returncode == 0:
        assert tags["mlflow.source.git.commit"] == commit.stdout.strip()
        assert config["git_commit"] == commit.stdout.strip()


def test_bad_trackers_are_one_line(tmp_path, monkeypatch):
    failures = []
    for overrides, expected in (
        (["run.trackers=[neptune]"], "'neptune' is not one of tensorboard, wandb, mlflow"),
        (["run.trackers=[wandb,wandb]"], "names a tracker twice"),
    ):
        with pytest.raises(UserError) as error:
            load_config(None, overrides)
        failures.append((str(error.value), expected))
    # A server that does not answer (port 9, discard): one line, once MLflow gives up.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with pytest.raises(UserError) as error:
        paisoar_jax.fit(
            None,
            [*TINY, "run.trackers=[mlflow]", "run.tracking_uri=http://127.0.0.1:9/"]
            + ["train.steps=1", f"run.dir={tmp_path / 'server'}"],
        )
    failures.append((str(error.value), "run.trackers=mlflow: MLflow at http://127.0.0.1:9/"))
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if it were not installed
    with pytest.raises(UserError) as error:
        paisoar_jax.fit(
            None,
            [*TINY, "run.trackers=[mlflow]", "train.steps=1", f"run.dir={tmp_path}"],
        )
    failures.append((str(error.value), 'pip install "paisoar-jax[mlflow]"'))
    for message, expected in failures:
        assert expected in message and "\n" not in message, message


def test_a_tracker_that_fails_mid_run_is_dropped_with_a_warning(tmp_path, capsys):
    """A tracker's server gone mid-run: one warning, training and metrics.jsonl go on."""
    from paisoar_jax.observe.metrics import MetricsWriter

    class Failing:
        def log(self, record):
            raise ConnectionError("the server went away")

        def close(self):
            raise AssertionError("a dropped tracker is not closed")

    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer._trackers = [Failing()]
    for step in (1, 2):
        writer.write({"step": step, "loss": 1.0})
    writer.close()
    assert [record["step"] for record in run_records(tmp_path)] == [1, 2]
    warnings = [line for line in capsys.readouterr().err.splitlines() if "Failing" in line]
    assert len(warnings) == 1 and "stopped taking metrics at step 1" in warnings[0]


def test_tensorboard_takes_a_skipped_steps_nan_without_a_warning(tmp_path, caplog):
    """Before: each fp16 step skipped for overflow (grad_norm NaN) printed tensorboardX's
    "NaN or Inf found in input tensor" on stderr; metrics.jsonl keeps the NaN."""
    from paisoar_jax.observe.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, tensorboard=True)
    writer.write({"step": 1, "loss": 2.0, "grad_norm": float("nan")})
    writer.close()
    assert not [record for record in caplog.records if "NaN or Inf" in record.getMessage()]
    assert [record["step"] for record in run_records(tmp_path)] == [1]
    assert list((tmp_path / "tensorboard").iterdir())


def test_every_tracker_the_config_accepts_has_a_class_and_no_other():
    """config/run.py's TRACKERS (what run.trackers may name) and the registry agree, and each
    class is one a metrics writer can drive (log, close, replays)."""
    from paisoar_jax.config.run import TRACKERS as NAMES
    from paisoar_jax.observe.trackers import TRACKERS

    assert tuple(TRACKERS) == NAMES
    for tracker in TRACKERS.values():
        assert callable(tracker.log) and callable(tracker.close)
        assert isinstance(tracker.replays, bool)
