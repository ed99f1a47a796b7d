"""The slow tier beside tests/numerics/test_precision.py: longer runs, more settings.

Mixed precision: matmuls in the compute dtype, fp32 islands, fp16 trains like fp32.
"""

import json

from test_precision import EXPLODING, final_losses, run_train


def test_fp16_default_model_ends_within_2_percent_of_fp32(tmp_path):
    finals = final_losses(["fp32", "fp16"], tmp_path)
    fp32, fp16 = finals["fp32"], finals["fp16"]
    assert fp32["loss_scale"] == 1.0 and fp16["loss_scale"] >= 1.0
    assert abs(fp16["loss"] - fp32["loss"]) / fp32["loss"] < 0.02, (fp16["loss"], fp32["loss"])
    assert fp16["loss"] < 3.0  # it did learn (4.2 at the start)


def test_fp16_scale_that_keeps_falling_warns_of_divergence(tmp_path):
    # Params blown up by a huge step: every later gradient overflows, however small the scale.
    result = run_train(
        "precision.policy=fp16",
        *EXPLODING,
        "train.steps=8",
        "train.log_every=1",
        f"run.dir={tmp_path / 'run'}",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "the loss scale fell at each of the last 3 log steps" in result.stderr
    assert "diverging, not just overflowing" in result.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert records[-1]["skipped_steps"] >= 5
    assert records[-1]["loss_scale"] <= 2.0**15 / 2**5
