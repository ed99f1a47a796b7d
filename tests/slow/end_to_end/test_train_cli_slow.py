"""The slow tier beside tests/end_to_end/test_train_cli.py: longer runs, more settings.

End to end through `python -m paisoar_jax.train`, as a user runs it.
"""

import json

import yaml
from conftest import TINY
from test_train_cli import FIELDS, run_train

from paisoar_jax.config import load_config


def test_sharded_training_run_writes_its_run_directory(tmp_path):
    result = run_train(
        *TINY,
        "run.tensorboard=true",
        "train.sample_bytes=20",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "train.steps=60",
        "train.log_every=10",
        "train.eval_every=30",
        "optim.warmup_steps=5",
        "run.dir=out",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "out"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [10, 20, 30, 40, 50, 60]
    for record in train_records:
        assert FIELDS <= record.keys()
        assert 0 <= record["data_wait_frac"] <= 1 and record["tokens_per_s"] > 0
        assert record["mfu"] is None  # no known peak for CPU devices
    assert train_records[-1]["loss"] < train_records[0]["loss"] - 0.3
    assert train_records[0]["compile_s"] > 0
    assert [r["step"] for r in records if "eval_loss" in r] == [30, 60]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["mesh"]["tensor"] == 2
    assert load_config(str(run_dir / "config.yaml")).train.steps == 60
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith("paisoar_jax: done: 60 steps") and "eval_loss" in last_line
    assert "sample:" in result.stdout


def test_grain_workers_from_the_command_line(tmp_path):
    result = run_train(
        *TINY, "data.workers=1", "train.steps=3", "train.eval_every=0", "mesh.data=8", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "done: 3 steps" in result.stdout
