"""`python -m paisoar_jax.bench`, as a user runs it: one JSON line of measured speed."""

import json

import pytest
from conftest import TINY, run_module


def bench(*args, cwd):
    result = run_module("bench", *args, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_data_only_times_the_pipeline(tmp_path):
    result = bench("--data-only", "--batches", "20", "--warmup", "2", *TINY, cwd=tmp_path)
    assert result["mode"] == "data" and result["batches"] == 20
    assert result["tokens_per_s"] > 0
    assert result["tokens_per_s"] == pytest.approx(result["batches_per_s"] * 16 * 32)
    assert result["source"] == "embedded"


def test_data_only_names_the_mixture_it_reads(tmp_path):
    """Before: a mixture was timed, and labelled data.source's default (embedded)."""
    mixture = "data.mixture=[[embedded,3],[synthetic,1]]"
    result = bench("--data-only", "--batches", "4", "--warmup", "1", *TINY, mixture, cwd=tmp_path)
    assert result["source"] == "mixture embedded x 3, synthetic x 1"
