"""Steps skipped on loss spikes (train.skip_spikes, engine/spikes.py).

A step whose loss is K standard deviations over the last 128 steps' mean changes nothing:
the parameters, the optimizer's moments and the model state stay bit for bit; the count
goes to metrics.jsonl; the window is optimizer state, so a resumed run judges as the
uninterrupted one; the doctor names the steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build_run, resumable_run, run_records, token_batches

from paisoar_jax.config import load_config
from paisoar_jax.engine import spikes
from paisoar_jax.errors import UserError


def window(losses):
    losses_W = jnp.zeros((spikes.WINDOW,), jnp.float32).at[: len(losses)].set(losses)
    return losses_W, jnp.int32(len(losses))


def test_a_spike_is_k_deviations_over_the_windows_mean():
    losses = 2.0 + 0.1 * np.random.default_rng(0).standard_normal(40)
    mean, deviation = losses.mean(), losses.std()
    losses_W, seen = window(losses)
    assert bool(spikes.is_spike(losses_W, seen, jnp.float32(mean + 3.1 * deviation), 3.0))
    assert not bool(spikes.is_spike(losses_W, seen, jnp.float32(mean + 2.9 * deviation), 3.0))
    # Before MIN_LOSSES steps nothing is judged.
    few_W, few = window(losses[: spikes.MIN_LOSSES - 1])
    assert not bool(spikes.is_spike(few_W, few, jnp.float32(100.0), 3.0))


def pattern_batch():
    """A batch the model learns fast (a repeating pattern), its loss falling smoothly."""
    tokens = (np.arange(33)[None, :] * 7 + np.arange(16)[:, None]) % 11
    return tokens.astype(np.int32)


def test_a_spike_step_changes_nothing_and_is_counted(devices):
    # (The window holds the whole fall, 5.6 to 0.9: one deviation over its mean is 4.2.)
    overrides = ["train.skip_spikes=1", "optim.warmup_steps=0", "optim.schedule=constant"]
    _, _, _, state, train_step = build_run(overrides, devices[:1])
    for _ in range(20):  # a smoothly falling loss fills the window
        state, metrics = train_step(state, pattern_batch())
    assert int(metrics["skipped_spikes"]) == 0
    before = jax.device_get(state)
    state, metrics = train_step(state, token_batches(1, seed=5)[0])  # random tokens: 6.6
    assert int(metrics["skipped_spikes"]) == 1
    after = jax.device_get(state)
    for old, new in zip(
        jax.tree.leaves((before.params, before.opt_state.inner_state)),
        jax.tree.leaves((after.params, after.opt_state.inner_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(old, new)
    assert int(after.step) == int(before.step) + 1
    state, metrics = train_step(state, pattern_batch())  # the next step trains again
    assert int(metrics["skipped_spikes"]) == 1
    moved = jax.device_get(state.params)
    assert any(
        not np.array_equal(old, new)
        for old, new in zip(jax.tree.leaves(after.params), jax.tree.leaves(moved), strict=True)
    )


def test_a_resumed_run_judges_its_spikes_as_the_uninterrupted_one(tmp_path):
    """A loss on a plateau (a learning rate of 1e-7) and a low K: the window decides."""
    settings = ["train.skip_spikes=0.3", "mesh.fsdp=2", "optim.lr=1e-7"]
    whole = resumable_run(tmp_path / "whole", settings, 27)
    resumable_run(tmp_path / "cut", settings, 21)
    resumed = resumable_run(tmp_path / "cut", settings, 27)
    assert [resumed[step] for step in range(22, 28)] == [whole[step] for step in range(22, 28)]
    skipped = [record["skipped_spikes"] for record in run_records(tmp_path / "whole")]
    assert skipped[-1] > 0 and skipped[15] == 0  # (nothing judged before 16 losses)
    cut = [record["skipped_spikes"] for record in run_records(tmp_path / "cut")]
    assert cut[-1] == skipped[-1]

    from paisoar_jax.tools.doctor.command import diagnose, load_run

    findings = {finding.name: finding for finding in diagnose(load_run(tmp_path / "whole"))}
    spike = findings["skipped-spikes"]
    assert f"{skipped[-1]} of 27 steps skipped as loss spikes" in spike.evidence


def test_bad_spike_settings_are_one_line():
    with pytest.raises(UserError, match="train.skip_spikes"):
        load_config(None, ["train.skip_spikes=-1"])
