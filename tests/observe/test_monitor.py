"""The loop's instruments: health checks (a non-finite loss without a scaler stops, a falling
scale warns), the step-time breakdown in metrics.jsonl and profiler traces."""

import contextlib
import io
import json
import math

import jax
import numpy as np
import optax
import pytest
from conftest import FIT_BASE, TINY, train
from flax import nnx

import paisoar_jax
from paisoar_jax.config import PrecisionConfig, load_config
from paisoar_jax.errors import DivergenceError, UserError
from paisoar_jax.observe.monitor import _skipped_in_a_row, check_health
from paisoar_jax.tools.doctor import command as doctor

FP32, FP16 = PrecisionConfig(), PrecisionConfig(policy="fp16")
STATIC = PrecisionConfig(policy="fp16", loss_scale="static:1024")
LOWER = "lower optim.lr"


def record(step, loss, scale, skipped=0):
    return {"step": step, "loss": loss, "loss_scale": scale, "skipped_steps": skipped}


def test_non_finite_loss_without_a_scaler_names_the_step():
    history = []
    check_health(record(10, 2.5, 1.0), FP32, history, LOWER)
    with pytest.raises(DivergenceError, match="the loss is nan at step 20 .last finite at step 10"):
        check_health(record(20, math.nan, 1.0), FP32, history, LOWER)


def test_with_a_scaler_a_non_finite_loss_is_only_a_skipped_step(capsys):
    history = []
    check_health(record(10, math.inf, 2.0**15, skipped=1), FP16, history, LOWER)
    assert history == [(10, 2.0**15, 1)] and capsys.readouterr().err == ""


def test_scale_falling_at_every_log_step_warns_once_it_is_a_trend(capsys):
    history = [(0, 2.0**15, 0), (5, 2.0**15, 0)]  # no step skipped: the scale found its level
    for step, scale in [(10, 2.0**15), (20, 2.0**14), (30, 2.0**13)]:
        check_health(record(step, 3.0, scale, skipped=step // 10), FP16, history, LOWER)
    assert capsys.readouterr().err == ""  # two falls: could still be overflow
    check_health(record(40, 3.0, 2.0**12, skipped=4), FP16, history, "lower your optimizer's lr")
    warning = capsys.readouterr().err
    assert "fell at each of the last 3 log steps" in warning
    assert "32768 at step 10 -> 4096 at step 40" in warning
    assert warning.strip().endswith("lower your optimizer's lr")  # not optim.lr: fit's own
    check_health(record(50, 3.0, 2.0**12, skipped=4), FP16, history, LOWER)
    assert capsys.readouterr().err == ""  # a steady scale is healthy again


def test_a_scale_coming_down_from_its_initial_value_neither_warns_nor_stops(capsys):
    """Before: a run started at precision.initial_scale=1e12 warned twice that its gradients
    were diverging while its loss fell and the scale found its level."""
    history = [(0, 1e12, 0)]
    for step in (5, 10, 15, 20, 25):  # every step skipped, the scale halved at each
        check_health(record(step, math.nan, 1e12 / 2**step, skipped=step), FP16, history, LOWER)
    check_health(record(30, 1.0, 1e12 / 2**25, skipped=25), FP16, history, LOWER)  # its level
    assert capsys.readouterr().err == ""  # and no stop: 25 skipped in a row, far above 1
    for index, step in enumerate((35, 40, 45), 26):  # settled, then falling: a trend
        check_health(record(step, 1.0, 1e12 / 2**index, skipped=index), FP16, history, LOWER)
    assert "fell at each of the last 3 log steps" in capsys.readouterr().err


def test_a_step_skipped_with_the_scale_at_its_floor_stops_the_run():
    """Before: fp16 trained to the end with 22 of 30 steps skipped, and exit 0."""
    history = []
    check_health(record(10, math.nan, 1.0, skipped=15), FP16, history, LOWER)  # reached it
    check_health(record(20, 2.0, 1.0, skipped=15), FP16, history, LOWER)  # all fine since
    with pytest.raises(DivergenceError, match=r"floor \(1, precision.min_scale\).*optim.lr"):
        check_health(record(30, math.nan, 1.0, skipped=16), FP16, history, LOWER)


def test_skipped_steps_in_a_row_stop_a_static_scale():
    history = []
    check_health(record(5, 2.0, 1024.0, skipped=0), STATIC, history, LOWER)
    for step, skipped in [(10, 5), (15, 10), (20, 14), (25, 19), (30, 24), (35, 29)]:
        check_health(record(step, math.nan, 1024.0, skipped), STATIC, history, LOWER)
    assert _skipped_in_a_row(history) == 15  # steps 21-35 (one of 16-20 trained)
    with pytest.raises(DivergenceError, match="the last 20 steps .to step 40. were all skipped"):
        check_health(record(40, math.nan, 1024.0, 34), STATIC, history, LOWER)


def test_skipped_steps_count_from_the_start_of_the_run(tmp_path):
    """Every step overflows at a static scale: the run stops after 20 skipped steps. Before:
    the first log interval was never counted, so it ran to step 25 (20 + train.log_every)."""

    def overflowing(model, batch, rng):
        loss, metrics = cross_entropy(model, batch, rng)
        return loss * 1e30, metrics

    overrides = [*FIT_BASE, "train.steps=40", "train.log_every=5", "precision.policy=fp16"]
    overrides += ["precision.loss_scale=static:1024", f"run.dir={tmp_path}/run"]
    with pytest.raises(DivergenceError, match="the last 20 steps .to step 20. were all skipped"):
        paisoar_jax.fit(None, overrides, model=Linear, loss=overflowing, data=batches())


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


class Linear(nnx.Module):
    def __init__(self, rngs):
        self.layer = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.layer(x)


def cross_entropy(model, batch, rng):
    logits = model(batch["x"]).astype(np.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def batches(nan_at=None):
    rng = np.random.default_rng(0)
    made = [
        {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": np.arange(16, dtype=np.int32) % 4}
        for _ in range(6)
    ]
    if nan_at is not None:
        made[nan_at]["x"][5, 1] = np.nan
    return made


@pytest.mark.parametrize("policy", ["fp32", "fp16"])
def test_a_batch_holding_nan_stops_the_run_naming_its_step_and_the_data(policy, tmp_path):
    """Before: fp32 said "the loss is nan at step 10: training diverged" (the log step, and
    an lr to lower); fp16 trained to the end with the steps skipped, and exit 0."""
    overrides = [*FIT_BASE, "train.steps=6", "train.log_every=5", f"precision.policy={policy}"]
    with pytest.raises(UserError) as stopped:
        paisoar_jax.fit(
            None,
            [*overrides, f"run.dir={tmp_path}/run"],
            model=Linear,
            loss=cross_entropy,
            data=batches(nan_at=2),
            optimizer=optax.adam(1e-2),
        )
    message = str(stopped.value)
    assert message.startswith(
        "the batch of step 3 holds non-finite values (batch['x']: 1 nan): the data is the "
        "cause, not the learning rate"
    )
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )  # nothing saved after it


def test_a_loss_that_masks_nan_may_turn_the_check_off(tmp_path):
    def masked(model, batch, rng):
        x = jax.numpy.nan_to_num(batch["x"])  # its own handling of missing values
        return cross_entropy(model, {**batch, "x": x}, rng)

    overrides = [*FIT_BASE, "train.steps=4", "data.check_finite=false", f"run.dir={tmp_path}"]
    result = paisoar_jax.fit(None, overrides, model=Linear, loss=masked, data=batches(nan_at=2))
    assert result["steps"] == 4 and np.isfinite(result["final_loss"])


def test_fp16_overflowing_at_the_scale_floor_stops_and_the_doctor_names_your_optimizer(tmp_path):
    """Gradients too large for fp16 at any scale: every step is skipped. Before: the run went
    on to its end (exit 0), and the doctor advised optim.lr, which fit's optimizer ignores."""

    def overflowing(model, batch, rng):
        loss, metrics = cross_entropy(model, batch, rng)
        return loss * 1e30, metrics  # its gradients overflow fp16 whatever the scale

    overrides = [*FIT_BASE, "train.steps=8", "precision.policy=fp16"]
    overrides += ["precision.initial_scale=4", f"run.dir={tmp_path}/run"]
    with pytest.raises(DivergenceError, match=r"floor \(1, precision.min_scale\).*your optimizer"):
        paisoar_jax.fit(
            None,
            overrides,
            model=Linear,
            loss=overflowing,
            data=batches(),  # every value finite
            optimizer=optax.adam(1e-2),
        )
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [record["skipped_steps"] for record in records] == [1, 2, 3]  # at 4, 2, then 1
    assert records[0]["lr_source"] == "optimizer"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert doctor.main([str(tmp_path / "run"), "--json"]) == 0
    fixes = [fix for finding in json.loads(out.getvalue())["findings"] for fix in finding["fixes"]]
    assert any("a lower learning rate in the optimizer given to fit" in fix for fix in fixes)
    assert not any("optim.lr" in fix.replace("(optim.lr is not used)", "") for fix in fixes)
