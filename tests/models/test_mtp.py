"""Multi-token prediction (models/mtp.py): its loss beside the next-token one, its causality.

The modules leave the decoder's own loss as it is (the same first step as without them, the
difference model.mtp_loss x their mean), module k at position i sees the tokens up to
i + k and no further, their targets stay inside a packed document, and an export leaves
them out (tests/slow/models/test_mtp_slow.py, with sharded steps equal to one device's).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build_run, token_batches
from flax import nnx

from paisoar_jax.config import load_config
from paisoar_jax.errors import UserError
from paisoar_jax.models import mtp
from paisoar_jax.numerics.precision import get_policy
from paisoar_jax.tasks.zoo import build_model

LLAMA = ["model.name=llama", "precision.policy=fp32", "train.global_batch=4"]


def first_step(overrides, devices):
    """The first train step's metrics (loss and the rest) on conftest's TINY."""
    _, _, _, state, train_step = build_run(overrides, devices)
    batch = token_batches(1, batch=4)[0]
    return {name: float(value) for name, value in train_step(state, batch)[1].items()}


@pytest.mark.checks("mtp", families=["zoo:llama"])
def test_the_modules_add_their_weighted_mean_loss_to_the_decoders_own(devices):
    """With experts (the modules' statistics join the decoder's), the logits chunked.

    (tests/slow/models/test_mtp_slow.py: dense, the logits whole, sharded.)
    """
    extra = ["model.experts=4", "model.loss_chunks=2"]
    plain = first_step([*LLAMA, *extra], devices[:1])
    depth = first_step([*LLAMA, *extra, "model.mtp_depth=2", "model.mtp_loss=0.5"], devices[:1])
    modules = (depth["mtp_loss/1"] + depth["mtp_loss/2"]) / 2
    main = depth["loss"] - 0.5 * modules
    # the router's losses also count the modules' experts: compared without them
    main -= 0.01 * (depth["moe_balance_loss"] - plain["moe_balance_loss"])
    np.testing.assert_allclose(main, plain["loss"], rtol=1e-5)
    assert 0 < depth["mtp_loss/1"] < 10 and 0 < depth["mtp_loss/2"] < 10


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_module_k_at_position_i_sees_the_tokens_up_to_i_plus_k(name):
    overrides = [*LLAMA, f"model.name={name}", "model.layers=2", "model.mtp_depth=2"]
    config = load_config(None, overrides).model
    with nnx.use_eager_sharding(False):  # its logical axis names, without a mesh
        model = build_model(config, get_policy("fp32"), "none", nnx.Rngs(params=0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 16)), jnp.int32)
    changed = tokens.at[0, 10].set((tokens[0, 10] + 1) % 256)
    before, _ = model.depth_streams_and_statistics(tokens)
    after, _ = model.depth_streams_and_statistics(changed)
    for k in range(3):  # the decoder's stream, then the modules'
        np.testing.assert_array_equal(before[k][0, : 10 - k], after[k][0, : 10 - k])
        assert not np.allclose(before[k][0, 10 - k], after[k][0, 10 - k])


def test_targets_ahead_stay_in_their_document_and_the_window():
    targets = jnp.arange(8)[None]
    learned = jnp.ones((1, 8)).at[0, 5].set(0)  # one target the loss skips
    segments = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1]])
    ahead_targets, weights = mtp.targets_ahead(targets, learned, segments, 2)
    np.testing.assert_array_equal(ahead_targets[0], [2, 3, 4, 5, 6, 7, 0, 0])
    # inputs 0, 4, 5 reach targets in their document; 1 and 2 cross into the next; 3's is
    # the skipped one; 6 and 7 reach past the window
    np.testing.assert_array_equal(weights[0], [1, 0, 0, 0, 1, 1, 0, 0])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.mtp_loss=0.1"], "model.mtp_loss is for multi-token prediction"),
        (["model.mtp_depth=-1"], "model.mtp_depth must be >= 0"),
        (["model.mtp_depth=1", "model.mtp_loss=-1"], "model.mtp_loss must be"),
    ],
)
def test_bad_mtp_keys_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


def test_mtp_over_context_parallelism_is_one_line(devices):
    with pytest.raises(UserError, match="model.mtp_depth with mesh.context > 1"):
        build_run([*LLAMA, "model.mtp_depth=1", "mesh.context=2", "mesh.data=1"], devices[:2])
