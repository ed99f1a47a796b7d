"""A CNN of your own with BatchNorm and Dropout, trained in bf16 or fp16, then used for inference.

    python examples/own_cnn.py [section.key=value ...]   # e.g. precision.policy=fp16

Handwritten 8 x 8 digits (scikit-learn's, no download: pip install scikit-learn). Dropout
draws from the loss's rng; BatchNorm keeps running statistics, which eval and inference use.
Under bf16 or fp16 the convolutions and the dense layer compute in that dtype while the
weights stay fp32 (fp16 adds loss scaling). Once trained, the run directory is loaded back
with paisoar_jax.load and classifies the held-out digits in plain Python.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import paisoar_jax


class CNN(nnx.Module):
    """Two convolutions with BatchNorm, global average pooling, Dropout, class logits."""

    def __init__(self, rngs: nnx.Rngs, classes: int = 10):
        self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
        self.norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
        self.norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.dropout = nnx.Dropout(0.2)
        self.out = nnx.Linear(64, classes, rngs=rngs)

    def __call__(self, image_BxHxWx1, rng=None):
        """Class logits; `rng` feeds Dropout in training (model.eval() turns it off)."""
        x_BxHxWxC = jax.nn.relu(self.norm1(self.conv1(image_BxHxWx1)))
        x_BxHxWxC = nnx.max_pool(x_BxHxWxC, (2, 2), strides=(2, 2))
        x_BxHxWxC = jax.nn.relu(self.norm2(self.conv2(x_BxHxWxC)))
        x_BxC = self.dropout(x_BxHxWxC.mean(axis=(1, 2)), rngs=rng)
        return self.out(x_BxC)


def loss(model, batch, rng):
    """Mean cross-entropy in fp32 (the logits cast up), and accuracy as a metric."""
    logits_BxK = model(batch["image"], rng).astype(jnp.float32)
    losses_B = optax.softmax_cross_entropy_with_integer_labels(logits_BxK, batch["label"])
    return losses_B.mean(), {"accuracy": (logits_BxK.argmax(-1) == batch["label"]).mean()}


def digits() -> tuple[dict, dict]:
    """(train, held-out) digits: images in [0, 1] as (N, 8, 8, 1), one in six held out."""
    features, labels = load_digits(return_X_y=True)
    images = (features.reshape(-1, 8, 8, 1) / 16).astype(np.float32)
    held_out = np.arange(len(labels)) % 6 == 0
    split = lambda keep: {"image": images[keep], "label": labels[keep].astype(np.int32)}
    return split(~held_out), split(held_out)


if __name__ == "__main__":
    train, held_out = digits()
    result = paisoar_jax.fit(
        None,
        [
            "run.name=own_cnn",
            "train.steps=400",
            "train.global_batch=64",
            "train.log_every=100",
            "train.eval_every=200",
            "optim.warmup_steps=20",
            *sys.argv[1:],
        ],
        model=CNN,
        loss=loss,
        optimizer=lambda schedule: optax.adamw(schedule, weight_decay=1e-4),
        data=train,
        eval_data=held_out,
    )
    if "eval_accuracy" in result:  # not when stopped early (Ctrl-C saves; rerun resumes)
        print(f"eval accuracy {result['eval_accuracy']:.4f}")
    # Inference in plain Python: the trained module, rebuilt from the run directory.
    model = paisoar_jax.load(result["run_dir"], model=CNN)
    model.eval()  # Dropout off, BatchNorm on its running statistics
    predicted = np.asarray(model(held_out["image"]).argmax(-1))
    right = np.mean(predicted == held_out["label"])
    print(f"loaded model: {right:.4f} of {len(predicted)} held-out digits right")
