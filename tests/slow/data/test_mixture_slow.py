"""The slow tier beside tests/data/test_mixture.py: longer runs, more settings.

data.mixture (paisoar_jax/data/mixture.py): shares, topologies, stages and resumes.
"""

import numpy as np
import pytest
from conftest import run_records


def test_two_processes_read_a_mixture_as_one_process_does(tmp_path):
    # Both through the CLI; the two-process launch tokenizes the hf source (process 0 does,
    # the other waits for it) and the one-process run reads that cache.
    import datasets
    from test_launch import train_one, train_two

    datasets.Dataset.from_list(
        [{"text": f"def f{i}(x):\n    return x * {i}\n" * 4} for i in range(300)]
    ).save_to_disk(str(tmp_path / "functions"))
    mixture = f"data.mixture=[[embedded,0.5],[hf:{tmp_path / 'functions'},0.3],[synthetic,0.2]]"
    settings = [mixture, f"data.cache_dir={tmp_path / 'cache'}", "data.mixture_stages=[[3,1,1,1]]"]
    settings += ["train.steps=4", "train.eval_every=2", "train.eval_batches=2"]
    two = train_two(tmp_path / "two", *settings)
    assert two.stdout.count("tokenized once") == 1  # process 0's note
    train_one(tmp_path / "one", *settings)
    one, two = run_records(tmp_path / "one"), run_records(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]
    for mine, reference in zip(two, one, strict=True):
        assert {k: v for k, v in mine.items() if k.startswith("examples/")} == {
            k: v for k, v in reference.items() if k.startswith("examples/")
        }
        keys = ["loss"] + [key for key in reference if key.startswith("eval_loss")]
        np.testing.assert_allclose([mine[k] for k in keys], [reference[k] for k in keys], rtol=1e-5)
    last = one[-1]
    assert last["examples/embedded"] + last["examples/functions"] + last["examples/synthetic"] == 64
    # eval_loss: the sources' eval losses, weighed by the weights at that step (equal here)
    names = ("embedded", "functions", "synthetic")
    mixed = sum(last[f"eval_loss/{name}"] for name in names) / 3
    assert last["eval_loss"] == pytest.approx(mixed, rel=1e-6)
    second = one[1]
    early = (
        0.5 * second["eval_loss/embedded"]
        + 0.3 * second["eval_loss/functions"]
        + 0.2 * second["eval_loss/synthetic"]
    )
    assert second["eval_loss"] == pytest.approx(early, rel=1e-6)
