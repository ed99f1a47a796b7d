"""The slow tier beside tests/tools/test_scaling.py: longer runs, more settings.

`bench_fit(..., scaling=True)`: a model of one's own measured on 1, 2, 4 and 8 devices.
"""

import json


def test_bench_fit_measures_the_scaling_of_a_model_of_ones_own(tmp_path, devices):
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import paisoar_jax

    def loss(model, batch, rng):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}

    data = {"x": np.ones((64, 8), np.float32), "y": np.zeros((64, 4), np.float32)}
    summary = paisoar_jax.bench_fit(
        None,
        ["train.global_batch=16", f"run.dir={tmp_path}"],
        model=lambda rngs: nnx.Linear(8, 4, rngs=rngs),
        loss=loss,
        data=data,
        scaling=True,
    )
    assert [row["devices"] for row in summary["weak"]] == [1, 2, 4, 8]
    assert json.loads((tmp_path / "scaling.json").read_text())["strong"][0]["efficiency"] == 1.0
