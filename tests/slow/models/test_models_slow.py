"""The slow tier beside tests/models/test_models.py: longer runs, more settings."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_models import make


def test_logits_in_the_compute_dtype_give_the_same_loss_and_gradients():
    """model.fp32_logits=false: bf16 logits (half the bytes), the loss still in fp32."""
    from conftest import task_for

    from paisoar_jax.config import Config

    tokens = jax.random.randint(jax.random.key(0), (4, 17), 0, 256)
    results = {}
    for fp32_logits in (True, False):
        config, model = make([f"model.fp32_logits={str(fp32_logits).lower()}"], policy="bf16")
        task = task_for(Config(model=config.model, data=config.data))
        assert model(tokens[:, :-1]).dtype == (jnp.float32 if fp32_logits else jnp.bfloat16)
        graphdef, params = nnx.split(model)

        def loss(params, graphdef=graphdef, task=task):
            return task.loss(nnx.merge(graphdef, params), tokens, jax.random.key(0))[0]

        results[fp32_logits] = jax.value_and_grad(loss)(params)
    (loss_32, grads_32), (loss_16, grads_16) = results[True], results[False]
    assert loss_16.dtype == jnp.float32
    np.testing.assert_allclose(loss_16, loss_32, rtol=1e-2)
    norm = lambda tree: float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(tree))))  # noqa: E731
    np.testing.assert_allclose(norm(grads_16), norm(grads_32), rtol=2e-2)
