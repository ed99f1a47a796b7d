"""The checked-in loss curves (tests/assets/losses, scripts/loss_curves.py): four shipped runs
train as they did when recorded, step for step, so a change that moves every configuration's
losses together does not pass unseen. `python scripts/loss_curves.py` regenerates them."""

import importlib.util
import json
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("loss_curves", REPO / "scripts" / "loss_curves.py")
loss_curves = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loss_curves)


@pytest.mark.parametrize("name", list(loss_curves.CURVES))
def test_the_run_follows_its_recorded_loss_curve(name):
    recorded = json.loads((loss_curves.ASSETS / f"{name}.json").read_text())
    measured = loss_curves.run_curve(name)
    assert measured["overrides"] == recorded["overrides"]  # the same run as recorded
    assert len(measured["losses"]) == len(recorded["losses"]) == loss_curves.STEPS
    moved = loss_curves.differences(recorded["losses"], measured["losses"])
    assert not moved, f"{name}'s losses moved (step, relative difference): {moved[:5]}"
    assert measured["losses"][-1] < 0.9 * measured["losses"][0]  # and the run learned


def test_the_comparison_sees_a_curve_that_moved():
    losses = [5.0, 4.0, 3.0]
    assert loss_curves.differences(losses, losses) == []
    moved = loss_curves.differences(losses, [5.0, 4.0, 3.0 * (1 + 3 * loss_curves.TOLERANCE)])
    assert [step for step, _ in moved] == [3]
