"""Muon (optim.name=muon, engine/muon.py): which parameters it orthogonalises, and a step.

The matrices and their axes come from the parameters' logical names; the rest is AdamW.
A sharded Muon step equals one device's, and a step's update of a matrix is orthogonal:
its singular values are (nearly) one number, where AdamW's spread.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_steps_match, step_losses
from flax import nnx
from optax.contrib import MuonDimensionNumbers as Axes

from paisoar_jax.config import load_config
from paisoar_jax.engine.muon import matrix_axes, muon_axes_tree
from paisoar_jax.errors import UserError

LLAMA = ["model.name=llama", "model.kv_heads=2", "optim.name=muon", "optim.warmup_steps=0"]


@pytest.mark.parametrize(
    ("names", "leaf", "expected"),
    [
        (("layers", "embed", "mlp"), "gate_kernel", Axes((1,), (2,))),
        (("layers", "mlp", "embed"), "down_kernel", Axes((1,), (2,))),
        (("layers", "embed", "heads", "head_dim"), "q_kernel", Axes((1,), (2, 3))),
        (("layers", "heads", "head_dim", "embed"), "out_kernel", Axes((1, 2), (3,))),
        (("layers", "experts", "embed", "mlp"), "gate_kernel", Axes((2,), (3,))),
        (("latent", "heads", "head_dim"), "kv_up_kernel", Axes((0,), (1, 2))),
        (("vocab", "embed"), "token_embedding", None),
        (("embed", "vocab"), "head", None),
        (("layers", "embed", "router"), "router_kernel", None),
        (("layers", "embed"), "scale", None),
        (("layers", "qkv", "heads", "head_dim"), "qkv_bias", None),
        ((None, None), "kernel", Axes(0, 1)),  # a model of one's own, without names
        ((None, None, None), "kernel", None),
    ],
)
def test_matrix_axes_follow_the_logical_names(names, leaf, expected):
    assert matrix_axes(names, len(names), leaf) == expected


def test_the_llamas_matrices_go_to_muon_and_the_rest_to_adamw():
    from conftest import TINY
    from flax import nnx

    from paisoar_jax.numerics.precision import get_policy
    from paisoar_jax.tasks.zoo import build_model

    config = load_config(None, [*TINY, *LLAMA])
    with nnx.use_eager_sharding(False):
        model = build_model(config.model, get_policy("fp32"), "none", nnx.Rngs(params=0))
    params = nnx.state(model, nnx.Param)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(params))
    axes = muon_axes_tree(specs, nnx.to_pure_dict(params))
    assert axes["token_embedding"] is None and axes["final_norm"]["scale"] is None
    blocks = axes["blocks"]  # scanned: axis 0 is the layers
    assert blocks["q_kernel"] == Axes((1,), (2, 3)) and blocks["out_kernel"] == Axes((1, 2), (3,))
    assert blocks["gate_kernel"] == Axes((1,), (2,)) and blocks["down_kernel"] == Axes((1,), (2,))
    assert blocks["attention_norm"]["scale"] is None


def muon_losses(mesh, devices):
    return step_losses([*LLAMA, *mesh], devices, steps=3)


def test_a_sharded_muon_step_equals_one_devices(devices):
    single, single_state = muon_losses(["mesh.data=1"], devices[:1])
    sharded, sharded_state = muon_losses(["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], devices)
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    assert_steps_match(sharded_state, single_state)


def test_muon_learns_a_batch_it_sees_again(devices):
    from conftest import build_run, token_batches

    _, _, layout, state, train_step = build_run([*LLAMA, "mesh.data=1", "mesh.fsdp=2"], devices[:2])
    # Its momentum is laid out as its parameter (found by the parameter's path).
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(layout.shardings.opt_state, is_leaf=is_sharding)
    moments = [
        found.spec
        for path, found in flat[0]
        if jax.tree_util.keystr(path).endswith("['blocks']['q_kernel']")
    ]
    assert moments == [layout.shardings.params["blocks"]["q_kernel"].spec]
    assert "fsdp" in str(moments[0])
    batch, losses = token_batches(1)[0], []
    for _ in range(6):
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.4, losses  # 5.56 -> 4.98 here (AdamW: 4.79)


def singular_value_spread(before, after, name):
    """The 90th over the 10th percentile singular value of each layer's update (D x rest).

    (The percentiles: a first step's gradient has a few near-null directions, which five
    Newton-Schulz steps leave small.)
    """
    update = np.asarray(after["blocks"][name]) - np.asarray(before["blocks"][name])
    spreads = []
    for layer in update:
        values = np.linalg.svd(layer.reshape(layer.shape[0], -1), compute_uv=False)
        spreads.append(np.percentile(values, 90) / np.percentile(values, 10))
    return max(spreads)


def test_a_muon_update_is_orthogonal_where_adamws_is_not(devices):
    base = ["model.name=llama", "model.kv_heads=2", "optim.warmup_steps=0"]
    base += ["optim.weight_decay=0"]  # (a decay step is no orthogonal matrix)
    _, muon = step_losses([*base, "optim.name=muon"], devices[:1], steps=1)
    _, adamw = step_losses(base, devices[:1], steps=1)
    for name in ("q_kernel", "gate_kernel"):  # 1.57 and 1.55 here
        assert singular_value_spread(*muon, name) < 1.8, name
    assert singular_value_spread(*adamw, "q_kernel") > 4  # 12.2 here


def test_bad_muon_settings_are_one_line():
    with pytest.raises(UserError, match=r"optim.muon_momentum must be in \[0, 1\)"):
        load_config(None, ["optim.name=muon", "optim.muon_momentum=1"])
    with pytest.raises(UserError, match="optim.muon_consistent_rms"):
        load_config(None, ["optim.name=muon", "optim.muon_consistent_rms=-1"])


class TwoLayers(nnx.Module):
    """A model of one's own, its parameters without logical names."""

    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.down = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def regression_loss(model, batch, rng):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}


def examples(count=256):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(count, 16)).astype(np.float32)
    return {"x": x, "y": np.tanh(x[:, :4] * 2).astype(np.float32)}


@pytest.mark.parametrize("how", ["optim.name=muon", "optax.contrib.muon"])
def test_a_model_of_ones_own_fits_with_muon(tmp_path, how):
    """The config's Muon (its 2-D kernels by Muon) or optax's given to fit, data x fsdp."""
    from conftest import FIT_BASE

    import paisoar_jax

    overrides = [*FIT_BASE, "train.steps=20", "mesh.data=4", "mesh.fsdp=2", "optim.lr=0.02"]
    overrides += [f"run.dir={tmp_path}/run", "optim.warmup_steps=0"]
    given = {}
    if how == "optim.name=muon":
        overrides.append(how)
    else:
        given["optimizer"] = optax.contrib.muon(0.02)
    result = paisoar_jax.fit(
        None, overrides, model=TwoLayers, loss=regression_loss, data=examples(), **given
    )
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    losses = [record["loss"] for record in records if "loss" in record]
    assert result["steps"] == 20 and losses[-1] < 0.5 * losses[0], losses


def test_a_resumed_muon_run_continues_exactly(tmp_path):
    """Its state (Muon's momentum, AdamW's moments, optax's masks) saved and restored."""
    from conftest import resumable_run

    settings = ["model.name=llama", "model.kv_heads=2", "optim.name=muon", "mesh.fsdp=2"]
    whole = resumable_run(tmp_path / "whole", settings, 6)
    resumable_run(tmp_path / "cut", settings, 3)
    resumed = resumable_run(tmp_path / "cut", settings, 6)
    assert [resumed[step] for step in range(4, 7)] == [whole[step] for step in range(4, 7)]
