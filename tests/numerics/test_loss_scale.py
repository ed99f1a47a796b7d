"""Loss scaling: skip non-finite steps untouched, back off, grow, agree across meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build_run, token_batches

from paisoar_jax.config import OptimConfig, PrecisionConfig
from paisoar_jax.engine.optim import build_optimizer
from paisoar_jax.errors import UserError
from paisoar_jax.numerics.loss_scale import LossScaleState, loss_scaled
from paisoar_jax.parallel import sharding

PARAMS = {"kernel": jnp.ones((4, 3)), "bias": jnp.zeros(3)}


def adamw_chain():
    optimizer, _ = build_optimizer(OptimConfig(lr=0.1, warmup_steps=0), 10, 8)
    return optimizer


def grads(value=0.5, scale=2.0**15):
    return jax.tree.map(lambda p: jnp.full_like(p, value * scale), PARAMS)


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_non_finite_step_is_skipped_bit_identically(bad):
    optimizer = loss_scaled(adamw_chain())
    state = optimizer.init(PARAMS)
    _, state = optimizer.update(grads(), state, PARAMS)  # one real step: moments non-zero
    poisoned = grads()
    poisoned["kernel"] = poisoned["kernel"].at[2, 1].set(bad)
    updates, new_state = optimizer.update(poisoned, state, PARAMS)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
    for old, new in zip(
        jax.tree.leaves(state.inner_state), jax.tree.leaves(new_state.inner_state), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(old), np.asarray(new))  # counts too
    assert float(new_state.scale) == 2.0**14
    assert int(new_state.skipped_steps) == 1 and not bool(new_state.last_finite)
    # The next finite step goes through and counts from the state before the bad one.
    updates, after = optimizer.update(grads(scale=2.0**14), new_state, PARAMS)
    assert all(np.all(np.asarray(u) != 0) for u in jax.tree.leaves(updates))
    assert int(after.skipped_steps) == 1


def test_unscaled_gradients_give_the_same_update_as_no_scaling():
    plain, scaled = adamw_chain(), loss_scaled(adamw_chain(), initial_scale=1024.0)
    expected, _ = plain.update(grads(scale=1.0), plain.init(PARAMS), PARAMS)
    actual, _ = scaled.update(grads(scale=1024.0), scaled.init(PARAMS), PARAMS)
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_clipping_sees_unscaled_gradients():
    optimizer, _ = build_optimizer(
        OptimConfig(
            name="sgd",
            lr=1.0,
            warmup_steps=0,
            clip_norm=1.0,
            momentum=0.0,
            weight_decay=0.0,
            schedule="constant",
        ),
        10,
        8,
    )
    scaled = loss_scaled(optimizer, initial_scale=2.0**10)
    small = jax.tree.map(lambda p: jnp.full_like(p, 0.01 * 2.0**10), PARAMS)  # norm 0.035
    updates, _ = scaled.update(small, scaled.init(PARAMS), PARAMS)
    np.testing.assert_allclose(updates["kernel"], -0.01, rtol=1e-6)  # not clipped


def test_scale_grows_after_interval_and_stops_at_max():
    optimizer = loss_scaled(
        adamw_chain(), initial_scale=2.0**15, growth_interval=3, max_scale=2.0**17
    )
    state = optimizer.init(PARAMS)
    scales = []
    for _ in range(12):
        _, state = optimizer.update(grads(scale=float(state.scale)), state, PARAMS)
        scales.append(float(state.scale))
    assert scales == [2.0**15] * 2 + [2.0**16] * 3 + [2.0**17] * 7
    assert np.isfinite(scales).all()


def test_hysteresis_waits_for_consecutive_bad_steps():
    optimizer = loss_scaled(adamw_chain(), hysteresis=2)
    state = optimizer.init(PARAMS)
    nan_grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), PARAMS)
    _, state = optimizer.update(nan_grads, state, PARAMS)
    assert float(state.scale) == 2.0**15 and int(state.skipped_steps) == 1
    _, state = optimizer.update(nan_grads, state, PARAMS)
    assert float(state.scale) == 2.0**14 and int(state.skipped_steps) == 2


def test_scale_never_falls_below_min():
    optimizer = loss_scaled(adamw_chain(), initial_scale=2.0, min_scale=1.0)
    state = optimizer.init(PARAMS)
    nan_grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), PARAMS)
    for _ in range(3):
        _, state = optimizer.update(nan_grads, state, PARAMS)
    assert float(state.scale) == 1.0


def test_static_mode_keeps_its_scale():
    optimizer = loss_scaled(adamw_chain(), dynamic=False, initial_scale=128.0)
    state = optimizer.init(PARAMS)
    nan_grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), PARAMS)
    _, state = optimizer.update(nan_grads, state, PARAMS)
    assert float(state.scale) == 128.0 and int(state.skipped_steps) == 1


@pytest.mark.parametrize(
    "text, policy, expected",
    [
        ("auto", "fp16", ("dynamic", 1.0)),
        ("auto", "bf16", ("none", 1.0)),
        ("static:512", "fp16", ("static", 512.0)),
        ("none", "fp16", ("none", 1.0)),
    ],
)
def test_loss_scale_modes(text, policy, expected):
    assert PrecisionConfig(policy=policy, loss_scale=text).loss_scale_mode() == expected


@pytest.mark.parametrize("text", ["static:", "static:-3", "sometimes"])
def test_bad_modes(text):
    with pytest.raises(UserError, match="precision.loss_scale"):
        PrecisionConfig(policy="fp16", loss_scale=text)


FP16_OVERFLOWING = [
    "precision.policy=fp16",
    "precision.initial_scale=16777216",  # 2**24: the first steps overflow in fp16
    "precision.growth_interval=2",
]


def scale_trajectory(overrides, devices, steps=8):
    _, mesh, _, state, train_step = build_run(FP16_OVERFLOWING + overrides, devices)
    trajectory, skipped_params_unchanged = [], []
    with jax.set_mesh(mesh):
        for batch in token_batches(steps):
            before = jax.device_get(state.params)
            state, metrics = train_step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))
            metrics = jax.device_get(metrics)
            trajectory.append((float(metrics["loss_scale"]), int(metrics["skipped_steps"])))
            if len(trajectory) > 1 and trajectory[-1][1] > trajectory[-2][1]:
                after = jax.device_get(state.params)
                skipped_params_unchanged.append(
                    all(
                        np.array_equal(a, b)
                        for a, b in zip(
                            jax.tree.leaves(before), jax.tree.leaves(after), strict=True
                        )
                    )
                )
    assert isinstance(state.opt_state, LossScaleState)
    return trajectory, skipped_params_unchanged
