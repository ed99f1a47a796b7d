"""The loop never waits on the device between log steps: one explicit fetch per log step."""

import traceback

import jax
import jax.numpy as jnp
from conftest import TINY, train
from jax._src import array as jax_array

from paisoar_jax.config import load_config


def test_no_host_sync_between_log_steps(tmp_path, monkeypatch):
    """Every read of a device value on the host (float(), bool(), np.asarray, device_get)
    goes through ArrayImpl._value; the loop may read only inside its jax.device_get, once
    per log step. (A transfer guard would say nothing on CPU, where arrays live on the host.)
    """
    fetches, implicit, inside = [], [], [False]
    device_get, value = jax.device_get, jax_array.ArrayImpl._value

    def counted(tree):
        fetches.append(1)
        inside[0] = True
        try:
            return device_get(tree)
        finally:
            inside[0] = False

    def watched(array):
        if not inside[0]:
            implicit.append("".join(traceback.format_stack(limit=6)))
        return value.fget(array)

    monkeypatch.setattr(jax, "device_get", counted)
    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(watched))
    float(jnp.ones(()) + 1)  # the probe sees an implicit read
    assert len(implicit) == 1
    implicit.clear()
    overrides = ["mesh.data=8", "train.steps=12", "train.log_every=4", "train.eval_every=0"]
    config = load_config(
        None, [*TINY, *overrides, "checkpoint.enabled=false", f"run.dir={tmp_path}"]
    )
    summary = train(config)
    assert summary["steps"] == 12
    # One fetch of the metrics per log step, and one of the first step's loss and gradient
    # norm (a step the loop waits for anyway: run_records.check_first_step).
    assert len(fetches) == 12 // 4 + 1
    assert not implicit, implicit[0]


def test_ready_batches_say_in_one_line_when_their_position_cannot_continue():
    """A user's grain IterDataset keeps a per-process position; when it cannot be used (the
    process count changed, or the checkpoint holds a global-sampler position) the run says
    so and its input restarts."""
    import grain
    import numpy as np

    from paisoar_jax.checkpointing.checkpoint import Restored
    from paisoar_jax.data.user_data import open_user_data
    from paisoar_jax.run.resume import resume_input

    config = load_config(None, TINY)
    batches = [{"x": np.full((4, 2), i, np.float32)} for i in range(3)]
    data = open_user_data(grain.MapDataset.source(batches).to_iter_dataset(), "data")
    iterator = data.batches(4, seed=0, shuffle=True, workers=0)
    changed = Restored(4, None, None, {}, input_changes="process_count 2 -> 1")
    note = resume_input(iterator, changed, config.data, config.train)
    assert note == (
        "checkpoint step 4 holds no input position this run can continue (the input changed "
        "since: process_count 2 -> 1): the input restarts from its first batch"
    )
    global_position = Restored(4, None, {"sampler": "global", "examples": 64}, {})
    assert "the input is now ready batches" in resume_input(
        iterator, global_position, config.data, config.train
    )
    next(iterator)
    kept = Restored(4, None, iterator.get_state(), {})
    resumed = data.batches(4, seed=0, shuffle=True, workers=0)
    assert resume_input(resumed, kept, config.data, config.train) is None
    assert next(resumed)["x"][0, 0] == 1  # after the one batch read
