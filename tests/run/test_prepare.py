"""paisoar_jax.prepare: a loop of one's own over fit's pieces trains exactly as fit does."""

import json

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import paisoar_jax


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x_Bx8):
        return self.out(nnx.relu(self.hidden(x_Bx8)))


def loss(model, batch, rng):
    logits = model(batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


X = np.random.default_rng(0).normal(size=(256, 8)).astype(np.float32)
DATA = {"x": X, "y": (X[:, :4].argmax(-1)).astype(np.int32)}
SETTINGS = ["mesh.data=4", "mesh.fsdp=2", "precision.policy=bf16", "train.global_batch=32",
            "train.steps=6", "train.log_every=1", "train.eval_every=0", "run.progress=false",
            "optim.lr=0.01", "optim.warmup_steps=2"]  # fmt: skip


def test_a_loop_of_ones_own_over_prepare_gives_fits_losses(tmp_path):
    paisoar_jax.fit(None, [*SETTINGS, f"run.dir={tmp_path / 'fit'}"], model=MLP, loss=loss,
                    data=DATA, optimizer=None)  # fmt: skip
    records = (tmp_path / "fit" / "metrics.jsonl").read_text().splitlines()
    fit_losses = [json.loads(line)["loss"] for line in records]

    # The loop a user writes: fit's pieces, the actions their own.
    prepared = paisoar_jax.prepare(
        None, [*SETTINGS, f"run.dir={tmp_path / 'own'}"], model=MLP, loss=loss, data=DATA
    )
    state, losses = prepared.state, []
    for _, batch in zip(range(6), prepared.batches(), strict=False):
        state, metrics = prepared.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert prepared.save(state) == 6
    prepared.close()

    assert len(fit_losses) == 6
    np.testing.assert_allclose(losses, fit_losses, rtol=1e-6)
    assert losses[-1] < losses[0]  # it trained
    model = prepared.model(state)  # the module of the state: what fit's result.model holds
    assert model(X[:2]).shape == (2, 4)
    resumed = paisoar_jax.prepare(
        None, [*SETTINGS, f"run.dir={tmp_path / 'own'}"], model=MLP, loss=loss, data=DATA
    )
    assert resumed.start_step == 6 and int(resumed.state.step) == 6
    resumed.close()
