"""The loop's instruments: health checks (a non-finite loss without a scaler stops, a falling
scale warns), the step-time breakdown in metrics.jsonl and profiler traces."""

import json
import math

import pytest
from conftest import TINY

from paisoar_jax.config import load_config
from paisoar_jax.errors import DivergenceError
from paisoar_jax.loop import train
from paisoar_jax.monitor import check_health


def record(step, loss, scale):
    return {"step": step, "loss": loss, "loss_scale": scale}


def test_non_finite_loss_without_a_scaler_names_the_step():
    history = []
    check_health(record(10, 2.5, 1.0), loss_scaled=False, history=history)
    with pytest.raises(DivergenceError, match="the loss is nan at step 20 .last finite at step 10"):
        check_health(record(20, math.nan, 1.0), loss_scaled=False, history=history)


def test_with_a_scaler_a_non_finite_loss_is_only_a_skipped_step(capsys):
    history = []
    check_health(record(10, math.inf, 2.0**15), loss_scaled=True, history=history)
    assert history == [(10, 2.0**15)] and capsys.readouterr().err == ""


def test_scale_falling_at_every_log_step_warns_once_it_is_a_trend(capsys):
    history = []
    for step, scale in [(10, 2.0**15), (20, 2.0**14), (30, 2.0**13)]:
        check_health(record(step, 3.0, scale), loss_scaled=True, history=history)
    assert capsys.readouterr().err == ""  # two falls: could still be overflow
    check_health(record(40, 3.0, 2.0**12), loss_scaled=True, history=history)
    warning = capsys.readouterr().err
    assert "fell at each of the last 3 log steps" in warning
    assert "32768 at step 10 -> 4096 at step 40" in warning
    check_health(record(50, 3.0, 2.0**12), loss_scaled=True, history=history)
    assert capsys.readouterr().err == ""  # a steady scale is healthy again


def test_a_run_records_its_step_time_breakdown_and_profiles_the_steps_asked_for(tmp_path, capfd):
    """metrics.jsonl has the breakdown fields; train.profile_steps leaves a trace behind."""
    overrides = [*TINY, "train.steps=4", "train.log_every=2", "train.eval_every=0"]
    overrides += ["train.profile_steps=[2,3]", "checkpoint.enabled=false", f"run.dir={tmp_path}"]
    train(load_config(None, overrides))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last = records
    assert first["param_count"] > 0 and "compile_s" in first and "param_count" not in last
    for record in records:
        assert 0 <= record["data_wait_frac"] + record["host_frac"] <= 1.01
        assert 0 < record["device_step_s"] <= record["step_time_s"]
        assert record["recompiles"] == 0
        # The CPU backend reports no memory statistics: the fields are there, and null.
        assert record["memory_peak_bytes"] is None and "memory_limit_bytes" in record
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert list((tmp_path / "profile").rglob("*.trace.json.gz"))  # Perfetto opens these
    assert "profiled steps 2-3" in capfd.readouterr().err


def test_a_diverged_run_keeps_the_record_that_shows_it(tmp_path):
    overrides = [*TINY, "train.steps=30", "train.log_every=1", "train.eval_every=0"]
    overrides += ["optim.lr=1e4", "checkpoint.enabled=false", f"run.dir={tmp_path}"]
    with pytest.raises(DivergenceError):
        train(load_config(None, overrides))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert not math.isfinite(json.loads(lines[-1])["loss"])
