"""The slow tier beside tests/runtime/test_full_disk.py: longer runs, more settings.

A full disk (paisoar_jax/runtime/full_disk.py): a real run on a 24 MB tmpfs, then room again.
"""

import re

from test_full_disk import (
    small_disk,  # noqa: F401 (fixtures)
    train,
)


def test_a_full_disk_is_one_line_keeps_the_last_checkpoint_and_a_rerun_resumes(small_disk):
    mount, grow = small_disk
    run_dir = mount / "run"
    result = train(run_dir, "train.steps=20")
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip()
    assert re.fullmatch(
        rf"paisoar_jax.train: error: the disk is full under {re.escape(str(run_dir))}/"
        r"checkpoints: a save needs about 1\d.\d MB and \d.\d MB is free; nothing partial is "
        r"left and the newest complete checkpoint is step 2, which a rerun resumes from "
        r"once there is room \(or set checkpoint.dir on a larger disk, checkpoint.keep lower\)",
        line,
    ), line
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["2"]
    grow()
    result = train(run_dir, "train.steps=6")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from step 2" in result.stdout
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["2", "4", "6"]
