"""The hang watchdog (paisoar_jax/runtime/watchdog.py): its clock, and a run whose input stalls.

The other half, a process whose collective never returns and which the watchdog ends
with status 3, is a real 2-process job in test_restarts.py.
"""

import time

import pytest
from conftest import TINY, train

from paisoar_jax.config import load_config
from paisoar_jax.errors import HangError, UserError
from paisoar_jax.runtime import heartbeat, watchdog
from paisoar_jax.tasks import builtin as tasks


def test_the_default_is_on_for_several_processes_only():
    assert watchdog.timeout_for(watchdog.AUTO, 1) == 0
    assert watchdog.timeout_for(watchdog.AUTO, 2) == watchdog.AUTO_TIMEOUT_S
    assert watchdog.timeout_for(30, 1) == 30
    assert watchdog.timeout_for(0, 8) == 0


@pytest.mark.parametrize("value", ["-2", "nan", "inf"])
def test_a_bad_timeout_is_one_line(value):
    with pytest.raises(UserError, match=r"train.hang_timeout_s must be seconds >= 0"):
        load_config(None, [f"train.hang_timeout_s={value}"])


def test_it_fires_once_without_progress_and_never_while_paused(capsys, monkeypatch):
    monkeypatch.setattr(heartbeat, "progress", heartbeat.Progress())  # this test's own
    requests = []
    with watchdog.Watchdog(0.3, "process 0 of 1", lambda: requests.append(1)) as dog:
        time.sleep(0.6)
        assert not dog.fired  # not armed before the first step
        dog.progressed(1)
        with dog.paused():  # a compile
            time.sleep(0.6)
        assert not dog.fired
        dog.phase = "data"
        time.sleep(0.8)
        assert dog.fired and requests == [1]
    # Recorded as this rank's failure: a launcher names it, not a peer it made fail.
    assert heartbeat.progress.error.startswith("process 0 of 1: no step finished in 0.3 s")
    line = capsys.readouterr().err.strip()
    assert line == (
        "paisoar_jax: error: process 0 of 1: no step finished in 0.3 s "
        "(train.hang_timeout_s); last step 1, waiting in: data; asking for a save, exiting "
        "with status 3 if none comes within another 0.3 s"
    )


class StallOnce:
    """Batches as they come, but the `at`-th takes `delay` seconds (a stuck file system)."""

    def __init__(self, batches, at: int, delay: float):
        self.batches, self.at, self.delay, self.count = batches, at, delay, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.count += 1
        if self.count == self.at:
            time.sleep(self.delay)
        return next(self.batches)

    def get_state(self):
        return self.batches.get_state()


def test_a_stall_that_clears_saves_and_ends_with_the_hang_status(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(heartbeat, "progress", heartbeat.Progress())
    """The input stalls 4.5 s at batch 12 with a 3 s timeout: the line (phase data), then
    the batch comes, the loop saves where it is and stops with HangError (exit status 3)."""
    make_batches = tasks.batch_dataset
    monkeypatch.setattr(
        tasks, "batch_dataset", lambda *a, **k: StallOnce(make_batches(*a, **k), 12, 4.5)
    )
    run_dir = tmp_path / "run"
    overrides = [*TINY, "train.steps=40", "train.eval_every=0", "checkpoint.every=0"]
    config = load_config(None, [*overrides, "train.hang_timeout_s=3", f"run.dir={run_dir}"])
    with pytest.raises(HangError, match=r"stopped by the hang watchdog after step (\d+); saved"):
        train(config)
    err = capsys.readouterr().err
    assert "process 0 of 1: no step finished in 3 s (train.hang_timeout_s)" in err, err
    assert "waiting in: data" in err
    saved = [path.name for path in (run_dir / "checkpoints").iterdir()]
    assert len(saved) == 1 and 8 < int(saved[0]) < 40, saved
