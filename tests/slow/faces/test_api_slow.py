"""The slow tier beside tests/faces/test_api.py: longer runs, more settings.

A model of one's own through `paisoar_jax.fit`: sharded like one device, fp16, bad input.
"""

import numpy as np
import pytest
from test_api import (
    BASE,
    RULES,
    Net,
    batches,
    net_loss,
    reference,  # noqa: F401 (fixtures)
    three_steps,
)

import paisoar_jax


@pytest.mark.parametrize(
    "overrides",
    [
        ["mesh.data=8", "mesh.grad_comm=bf16"],
        ["mesh.data=4", "mesh.tensor=2", f"sharding.rules={RULES}", "mesh.grad_comm=int8"],
        ["mesh.data=8", "mesh.zero=3", "mesh.grad_comm=int8", "mesh.grad_comm_error_feedback=true"],
    ],
    ids=["bf16", "int8-tensor2-rules", "int8-zero3-error-feedback"],
)
def test_a_model_of_ones_own_trains_with_compressed_gradients(reference, devices, overrides):
    """mesh.grad_comm turns on for a model of one's own as for the zoo: the same first
    forward pass, then steps within the wire dtype's rounding of one device's (Adam at
    lr 1e-2 turns a rounded near-zero gradient into a whole step: 2% on the loss)."""
    compressed = three_steps(overrides, devices)
    assert compressed["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-6)
    np.testing.assert_allclose(compressed["losses"], reference["losses"], rtol=2e-2)
    assert compressed["losses"] != reference["losses"]  # the exchange did round


def test_a_plain_iterable_says_its_input_restarts_on_resume(tmp_path, capsys):
    common = [*BASE, f"run.dir={tmp_path}", "optim.schedule=constant"]
    parts = {"model": Net, "loss": net_loss, "data": batches(3)}  # a list: no saved position
    paisoar_jax.fit(None, [*common, "train.steps=2"], **parts)
    assert "restarts" not in capsys.readouterr().out
    summary = paisoar_jax.fit(None, [*common, "train.steps=4"], **parts)
    assert summary["resumed_from"] == 2
    assert "it restarts from its first batch" in capsys.readouterr().out
