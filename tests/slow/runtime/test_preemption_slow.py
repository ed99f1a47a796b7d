"""The slow tier beside tests/runtime/test_preemption.py: longer runs, more settings.

Preemption with real processes: SIGTERM saves and exits 0, SIGINT (Ctrl-C) saves and exits
130, kill -9 loses nothing.
"""

import os
import signal

from test_preemption import (
    finish,
    losses,
    reference,  # noqa: F401 (fixtures)
    start,
    wait_for,
)


def test_kill_9_during_a_save_leaves_the_previous_checkpoint_usable(reference, tmp_path):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    process = start(run_dir, "checkpoint.every=1", "checkpoint.keep=100")

    def saving():
        names = [p.name for p in checkpoints.iterdir()] if checkpoints.exists() else []
        complete = [int(n) for n in names if n.isdigit()]
        return complete and max(complete) >= 5 and any("tmp" in n for n in names)

    wait_for(saving, process)
    os.kill(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    names = sorted(p.name for p in checkpoints.iterdir())
    half_written = [n for n in names if "tmp" in n]
    complete = sorted(int(n) for n in names if n.isdigit())
    assert half_written, names  # killed mid-save: a temporary step directory is left

    resumed = finish(start(run_dir, "checkpoint.every=1", "checkpoint.keep=100"))
    assert f"resumed from step {complete[-1]}" in resumed
    assert not [p for p in checkpoints.iterdir() if "tmp" in p.name]  # cleaned up
    assert losses(run_dir) == reference()
