"""Your own NNX model, loss and optax optimizer on a numpy dataset in memory.

    python examples/own_mlp.py [section.key=value ...]   # e.g. precision.policy=bf16 mesh.data=1

An MLP classifies points of three interleaved spirals. The arrays are the data: each row is
one example, and paisoar_jax shares them out over processes, shuffles and batches them.
"""

import sys

import jax
import numpy as np
import optax
from flax import nnx

import paisoar_jax


class MLP(nnx.Module):
    """Two hidden layers with GELU, then class logits."""

    def __init__(self, rngs: nnx.Rngs, width: int = 128, classes: int = 3):
        self.hidden = nnx.Linear(2, width, rngs=rngs)
        self.middle = nnx.Linear(width, width, rngs=rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.out = nnx.Linear(width, classes, rngs=rngs)

    def __call__(self, x_BxF):
        """Class logits of a batch of points."""
        h_BxW = jax.nn.gelu(self.hidden(x_BxF))
        h_BxW = self.norm(jax.nn.gelu(self.middle(h_BxW)))
        return self.out(h_BxW)


def loss(model, batch, rng):
    """Mean cross-entropy, and accuracy as a metric."""
    logits_BxC = model(batch["point"])
    losses_B = optax.softmax_cross_entropy_with_integer_labels(logits_BxC, batch["label"])
    accuracy = (logits_BxC.argmax(-1) == batch["label"]).mean()
    return losses_B.mean(), {"accuracy": accuracy}


def spirals(count: int, seed: int) -> dict[str, np.ndarray]:
    """Three noisy spiral arms in the plane, one class each."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 3, count)
    radius = rng.uniform(0.1, 1.0, count)
    angle = 2 * np.pi * radius + label * 2 * np.pi / 3 + rng.normal(0, 0.1, count)
    point = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    return {"point": point.astype(np.float32), "label": label.astype(np.int32)}


if __name__ == "__main__":
    summary = paisoar_jax.fit(
        None,
        [
            "run.name=own_mlp",
            "train.steps=300",
            "train.global_batch=64",
            "train.log_every=50",
            "train.eval_every=100",
            "optim.warmup_steps=20",
            *sys.argv[1:],
        ],
        model=lambda rngs: MLP(rngs),
        loss=loss,
        optimizer=lambda schedule: optax.adamw(schedule, weight_decay=1e-4),
        data=spirals(4096, seed=0),
        eval_data=spirals(512, seed=1),
    )
    if "eval_accuracy" in summary:  # not when stopped early (Ctrl-C saves; rerun resumes)
        print(f"eval accuracy {summary['eval_accuracy']:.3f}")
