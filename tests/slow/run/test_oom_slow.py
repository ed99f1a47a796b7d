"""The slow tier beside tests/run/test_oom.py: longer runs, more settings.

Readable out-of-memory: the report, its fixes, and XLA's real RESOURCE_EXHAUSTED error.
"""

from conftest import TINY, run_module


def test_the_trainer_prints_the_report_for_a_step_over_its_memory_budget(tmp_path):
    """Through `python -m paisoar_jax.train`: the report, no traceback, exit status 2."""
    result = run_module(
        "train", *TINY, "train.memory_limit_gb=0.0001", "run.dir=out", cwd=tmp_path, timeout=120
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("paisoar_jax.train: error: out of memory:")
    assert "remat.policy=" in result.stderr and "train.grad_accum=" in result.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # stopped before the first step
