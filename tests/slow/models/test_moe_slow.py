"""The slow tier beside tests/models/test_moe.py: longer runs, more settings.

The MoE feed-forward against a token-by-token reference: routing, seats, drops, losses.
"""

import numpy as np
import pytest
from test_moe import LLAMA, MOE


@pytest.mark.checks("resume", families=["zoo:llama + experts"])
def test_a_moe_run_resumes_exactly_on_another_expert_split(tmp_path):
    """3 steps on mesh.expert=2, resumed to 6 on one expert shard = 6 steps straight."""
    from conftest import resumable_run

    settings = [*MOE, *LLAMA, "model.expert_capacity_factor=1.0", "mesh.data=2", "mesh.fsdp=2"]
    settings += ["model.router_bias_rate=0.01"]  # its biases are saved and restored too
    straight = resumable_run(tmp_path / "straight", [*settings, "mesh.expert=2"], 6)
    resumable_run(tmp_path / "cut", [*settings, "mesh.expert=2"], 3)
    resumed = resumable_run(tmp_path / "cut", [*settings, "mesh.data=4"], 6)
    assert [resumed[step] for step in (4, 5, 6)] == pytest.approx(
        [straight[step] for step in (4, 5, 6)], rel=1e-5
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["remat.policy=full", "mesh.expert=2"],
        ["precision.policy=bf16", "mesh.zero=1", "mesh.tensor=2"],
        ["precision.policy=fp16", "train.grad_accum=2", "mesh.expert=2"],
        ["model.router=sigmoid", "model.shared_experts=1", "model.router_z_loss=0.001"],
        ["precision.policy=fp8"],  # the attention in fp8, the experts in bf16
        ["model.name=gpt", "model.scan_layers=false", "model.layers=4", "model.moe_every=2"]
        + ["model.router_bias_rate=0.001"],
    ],
)
def test_every_moe_setting_trains(devices, overrides):
    from conftest import build_run, token_batches

    family = [] if "model.name=gpt" in overrides else LLAMA
    settings = [*MOE, *family, "model.expert_capacity_factor=1.25", "mesh.data=-1", *overrides]
    _, _, _, state, train_step = build_run(settings, devices[:4])
    values = []
    for batch in token_batches(2):
        state, metrics = train_step(state, batch)
        values.append(float(metrics["loss"]))
        assert 0 <= float(metrics["moe_dropped_fraction"]) < 1
    # That the setting compiles and trains: the numbers are checked against one device above.
    assert all(np.isfinite(values))
