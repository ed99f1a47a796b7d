"""The loop's health checks: a non-finite loss without a scaler stops, a falling scale warns."""

import math

import pytest

from paisoar_jax.errors import DivergenceError
from paisoar_jax.loop import check_health


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
