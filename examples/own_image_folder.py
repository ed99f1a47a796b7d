"""Your own vision model on your own folder of images, one sub-folder per class.

    python examples/own_image_folder.py PHOTOS_DIR [section.key=value ...]

PHOTOS_DIR/CLASS/*.jpg (or .png, ...), or PHOTOS_DIR/train and PHOTOS_DIR/val of that
shape, or a dataset `python -m paisoar_jax.convert images` wrote. `source_examples` reads
it as the command line reads data.source=images:PHOTOS_DIR: the held-out split, a new
random crop and flip of each training image every epoch, the centre crop for eval; the
batches stay uint8 until the model scales them on the device.
"""

import sys

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import paisoar_jax

IMAGE_SIZE = 32


class SmallCNN(nnx.Module):
    """Two strided convolutions with BatchNorm, global average pooling, class logits."""

    def __init__(self, rngs: nnx.Rngs, classes: int):
        self.conv1 = nnx.Conv(3, 32, (3, 3), strides=2, rngs=rngs)
        self.norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), strides=2, rngs=rngs)
        self.norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.out = nnx.Linear(64, classes, rngs=rngs)

    def __call__(self, image_BxHxWx3):
        """Class logits of uint8 images (scaled to [-1, 1] here, on the device)."""
        x_BxHxWx3 = image_BxHxWx3.astype(jnp.float32) / 127.5 - 1
        x_BxHxWxC = jax.nn.relu(self.norm1(self.conv1(x_BxHxWx3)))
        x_BxHxWxC = jax.nn.relu(self.norm2(self.conv2(x_BxHxWxC)))
        return self.out(x_BxHxWxC.mean(axis=(1, 2)))


def loss(model, batch, rng):
    """Mean cross-entropy in fp32, and accuracy as a metric."""
    logits_BxK = model(batch["image"]).astype(jnp.float32)
    losses_B = optax.softmax_cross_entropy_with_integer_labels(logits_BxK, batch["label"])
    return losses_B.mean(), {"accuracy": (logits_BxK.argmax(-1) == batch["label"]).mean()}


if __name__ == "__main__":
    folder, overrides = sys.argv[1], sys.argv[2:]
    # --8<-- [start:read]
    source = f"images:{folder}"
    train, held_out = paisoar_jax.source_examples(source, image_size=IMAGE_SIZE)
    # --8<-- [end:read]
    settings = ["run.name=own_image_folder", "train.steps=200", "train.global_batch=32"]
    result = paisoar_jax.fit(
        None,
        [*settings, *overrides],
        model=lambda rngs: SmallCNN(rngs, classes=len(train.classes)),
        loss=loss,
        optimizer=optax.adam(3e-3),
        data=train,
        eval_data=held_out,
    )
    print(f"classes {train.classes}, eval accuracy {result.get('eval_accuracy')}")
