"""The slow tier beside tests/models/test_vision_models.py: longer runs, more settings.

Vision models: shapes, parameter counts, FLOPs, logical names, precision, BatchNorm, remat.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from test_vision_models import TINY, abstract_model, apply, gradients, images_for


@pytest.mark.parametrize("name, remat", [("resnet18", "full"), ("vit_tiny", "minimal")])
def test_remat_gives_the_same_gradients(name, remat):
    graphdef, state = abstract_model(TINY[name], remat=remat)
    images = images_for(TINY[name])
    jaxpr = jax.make_jaxpr(lambda s: apply(graphdef, s, images, True))(state)
    checkpoints = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("checkpoint", "remat2")]
    assert len(checkpoints) == len(nnx.merge(graphdef, state).blocks)  # one per block
    reference_grads, reference_stats = gradients(name, "none")
    grads, stats = gradients(name, remat)
    assert any(np.abs(g).max() > 0 for g in jax.tree.leaves(reference_grads))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(reference_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    for got, want in zip(jax.tree.leaves(stats), jax.tree.leaves(reference_stats), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
