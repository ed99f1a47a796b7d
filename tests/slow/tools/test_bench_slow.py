"""The slow tier beside tests/tools/test_bench.py: longer runs, more settings.

`python -m paisoar_jax.bench`, as a user runs it: one JSON line of measured speed.
"""

import pytest
from conftest import TINY
from test_bench import bench


def test_training_bench_reports_speed_on_synthetic_tokens(tmp_path):
    named = "data.eval_sets=[[synthetic,2,noise],[embedded,0,text]]"  # bench evaluates none
    result = bench(*TINY, "train.steps=6", "train.log_every=2", named, cwd=tmp_path)
    assert result["mode"] == "train" and result["steps"] == 6
    assert result["step_ms"] > 0 and result["compile_s"] > 0
    assert result["tokens_per_s"] == pytest.approx(16 * 32 / (result["step_ms"] / 1e3))
    assert 0 <= result["data_wait_frac"] <= 1
    records = (tmp_path / "runs" / "bench" / "default" / "metrics.jsonl").read_text()
    assert "eval_" not in records
    assert not (tmp_path / "runs" / "bench" / "default" / "checkpoints").exists()
    assert result["estimate"] is None  # only on a GPU that is a plan target (H200, H100)


def test_overhead_compares_the_loop_with_a_bare_one(tmp_path):
    result = bench("--overhead", "train.steps=40", "train.log_every=20", cwd=tmp_path)
    assert result["mode"] == "overhead" and result["steps"] == 40
    assert result["library_ms"] > 0 and result["bare_ms"] > 0
    assert result["ratio"] == pytest.approx(result["library_ms"] / result["bare_ms"])
    pieces = ("input_wait", "dispatch", "input_produce", "prefetch_handoff", "batch_check")
    pieces += ("progress_bar", "signal_check", "metrics")
    for name in pieces:
        assert result[f"{name}_ms"] >= 0, name
