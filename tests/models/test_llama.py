"""The Llama decoder: sharded steps match one device, every setting runs, bad shapes refused."""

import jax
import numpy as np
import pytest
from conftest import assert_steps_match, build_run, step_losses
from flax import nnx

from paisoar_jax.config import LanguageModelConfig, load_config
from paisoar_jax.errors import UserError
from paisoar_jax.models.llama import Llama
from paisoar_jax.numerics.precision import get_policy

LLAMA = ["model.name=llama", "model.kv_heads=2", "model.mlp_width=96"]


def losses(overrides, devices, steps=3):
    return step_losses([*LLAMA, *overrides], devices, steps)


@pytest.mark.checks("sharded", families=["zoo:llama"])
def test_a_sharded_step_matches_one_device(devices):
    single, single_state = losses(["mesh.data=1"], devices[:1])
    sharded, sharded_state = losses(["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], devices)
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    assert_steps_match(sharded_state, single_state)


def test_every_param_has_logical_axis_names_and_the_model_is_causal():
    config = LanguageModelConfig(name="llama", kv_heads=2, width=32, heads=4, layers=2)
    with nnx.use_eager_sharding(False):
        model = Llama(config, get_policy("fp32"), "none", nnx.Rngs(params=0))
    params = nnx.state(model, nnx.Param)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(params))
    shapes = jax.tree.map(np.shape, nnx.to_pure_dict(params))
    is_spec = lambda leaf: isinstance(leaf, jax.sharding.PartitionSpec)  # noqa: E731
    for spec, shape in zip(
        jax.tree.leaves(specs, is_leaf=is_spec),
        jax.tree.leaves(shapes, is_leaf=lambda leaf: isinstance(leaf, tuple)),
        strict=True,
    ):
        assert len(spec) == len(shape) and None not in spec
    assert specs["blocks"]["k_kernel"] == jax.sharding.PartitionSpec(
        "layers", "embed", "kv_heads", "head_dim"
    )
    tokens = np.arange(32, dtype=np.int32).reshape(2, 16) % 256
    logits, changed = model(tokens), model(np.where(np.arange(16) == 10, 7, tokens))
    np.testing.assert_allclose(changed[:, :10], logits[:, :10], atol=1e-5)
    assert not np.allclose(changed[:, 10:], logits[:, 10:])


def test_a_tensor_size_that_does_not_divide_the_kv_heads_is_refused(devices):
    with pytest.raises(UserError, match=r"model.kv_heads=2 is not divisible by mesh.tensor=4"):
        build_run([*LLAMA, "mesh.data=2", "mesh.tensor=4"], devices)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.kv_heads=3"], "model.heads=4 is not divisible by model.kv_heads=3"),
        (["model.name=gpt", "model.kv_heads=2"], "model.kv_heads is for model.name=llama"),
        (["model.rope_high_freq_factor=0.5"], "must be above model.rope_low_freq_factor=1.0"),
        (["model.rope_theta=0"], "model.rope_theta must be a finite number > 0"),
        (["model.rope_scaling=dynamic"], "'dynamic' is not one of none, llama3, linear, yarn"),
    ],
)
def test_bad_llama_settings_get_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, ["model.name=llama", *overrides])


def test_llama_positions_are_always_rotary_and_shipped_shapes_are_the_real_ones():
    assert load_config(None, ["model.name=llama"]).model.position == "rotary"
    small = load_config("llama3_1b").model
    assert (small.layers, small.width, small.heads, small.kv_heads, small.mlp_width) == (
        16,
        2048,
        32,
        8,
        8192,
    )
    assert (small.vocab_size, small.rope_theta, small.rope_factor) == (128256, 500000.0, 32.0)
    big = load_config("llama3_8b").model
    assert (big.layers, big.width, big.mlp_width, big.tie_embeddings) == (32, 4096, 14336, False)
