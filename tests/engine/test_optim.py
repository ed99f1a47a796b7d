import dataclasses

import jax
import numpy as np
import optax
import pytest

from paisoar_jax.config import OptimConfig, load_config
from paisoar_jax.engine.optim import build_lr_schedule, build_optimizer, decay_mask, scaled_lr
from paisoar_jax.run.setup import optimizer_for


def test_warmup_then_cosine_to_final_fraction():
    config = OptimConfig(lr=1.0, warmup_steps=10, schedule="cosine", final_lr_fraction=0.1)
    schedule = build_lr_schedule(config, total_steps=110, global_batch=8)
    assert float(schedule(0)) == pytest.approx(0.1)  # peak / warmup: the first step learns
    assert float(schedule(10)) == pytest.approx(1.0)
    assert float(schedule(60)) == pytest.approx(0.55, rel=1e-3)  # half way down the cosine
    assert float(schedule(110)) == pytest.approx(0.1)


def test_linear_and_constant_schedules():
    linear = build_lr_schedule(
        OptimConfig(lr=2.0, warmup_steps=0, schedule="linear", final_lr_fraction=0.0), 100, 8
    )
    assert float(linear(50)) == pytest.approx(1.0)
    constant = build_lr_schedule(OptimConfig(lr=2.0, warmup_steps=0, schedule="constant"), 100, 8)
    assert float(constant(99)) == pytest.approx(2.0)


@pytest.mark.parametrize("rule, expected", [("none", 0.1), ("linear", 0.4), ("sqrt", 0.2)])
def test_lr_scaling_for_the_global_batch(rule, expected):
    config = OptimConfig(lr=0.1, lr_scaling=rule, base_batch=256)
    assert scaled_lr(config, global_batch=1024) == pytest.approx(expected)


def test_weight_decay_skips_norms_and_biases():
    params = {
        "blocks": {
            "attention_norm": {"scale": 1.0, "bias": 0.0},
            "qkv_kernel": 1.0,
            "qkv_bias": 0.0,
        },
        "token_embedding": 1.0,
    }
    mask = decay_mask(params)
    assert mask == {
        "blocks": {
            "attention_norm": {"scale": False, "bias": False},
            "qkv_kernel": True,
            "qkv_bias": False,
        },
        "token_embedding": True,
    }


@pytest.mark.parametrize("name", ["adamw", "sgd", "lamb", "lars"])
def test_optimizers_decay_only_masked_params_and_clip(name):
    config = OptimConfig(
        name=name,
        lr=0.5,
        warmup_steps=0,
        schedule="constant",
        weight_decay=0.5,
        clip_norm=1.0,
        momentum=0.0,
    )
    optimizer, _ = build_optimizer(config, total_steps=10, global_batch=8)
    params = {"kernel": np.ones(3, np.float32), "bias": np.ones(3, np.float32)}
    zero_grads = jax.tree.map(np.zeros_like, params)
    updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
    assert np.all(np.asarray(updates["bias"]) == 0)  # no gradient, no decay
    assert np.all(np.asarray(updates["kernel"]) < 0)  # decayed towards zero
    huge = {"kernel": np.full(3, 1e6, np.float32), "bias": np.zeros(3, np.float32)}
    if name == "sgd":
        updates, _ = optimizer.update(
            huge, optimizer.init(params), jax.tree.map(np.zeros_like, params)
        )
        assert float(np.linalg.norm(np.asarray(updates["kernel"]))) == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_layerwise_trust_ratio_scales_steps_to_the_weights(name):
    # Whatever the gradient's size, a layer moves by lr x (trust ratio) x its own norm.
    config = OptimConfig(
        name=name, lr=0.1, warmup_steps=0, schedule="constant", weight_decay=0.0, clip_norm=0.0
    )
    config = dataclasses.replace(config, momentum=0.0, trust_coefficient=0.01)
    optimizer, _ = build_optimizer(config, total_steps=10, global_batch=8)
    params = {"kernel": np.full(4, 3.0, np.float32)}  # norm 6
    for gradient_size in (1e-3, 1e3):
        grads = {"kernel": np.full(4, gradient_size, np.float32)}
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        step = float(np.linalg.norm(np.asarray(updates["kernel"])))
        expected = 0.1 * 0.01 * 6.0 if name == "lars" else 0.1 * 6.0
        assert step == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize(
    "overrides, own, expected_norm",
    [
        ([], False, 1.0),  # the config's optimizer: clipped at 1.0 unless told otherwise
        ([], True, 1e6 * np.sqrt(3)),  # a user's optax chain runs as given
        (["optim.clip_norm=2"], True, 2.0),  # ... and is clipped when asked
        (["optim.clip_norm=0"], False, 1e6 * np.sqrt(3)),
        (["optim.clip_norm=null"], False, 1.0),  # unset again, as a saved config says
    ],
)
def test_clipping_wraps_a_users_optimizer_only_when_asked(overrides, own, expected_norm):
    config = load_config(
        None,
        ["optim.name=sgd", "optim.lr=1", "optim.warmup_steps=0", "optim.schedule=constant"]
        + ["optim.weight_decay=0", "optim.momentum=0", *overrides],
    )
    optimizer, _, _ = optimizer_for(
        optax.sgd(1.0) if own else None, config.optim, config.train, config.precision
    )
    params = {"kernel": np.zeros(3, np.float32)}
    huge = {"kernel": np.full(3, 1e6, np.float32)}
    updates, _ = optimizer.update(huge, optimizer.init(params), params)
    assert float(np.linalg.norm(np.asarray(updates["kernel"]))) == pytest.approx(expected_norm)
