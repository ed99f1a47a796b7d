"""Image sources held in memory: scikit-learn's digits and synthetic images.

Digits is a real dataset that needs no download; synthetic images feed benchmarks.

Both give items {"image": uint8 (H, W, C), "label": int} already decoded, which the image
pipeline (data/images.py) batches without Pillow, and neither is augmented: a mirrored or
cropped 8 x 8 digit is another digit or none, and a benchmark measures the model, not the
host's crops (`bench --data-only` on a real image folder measures those).
"""

from __future__ import annotations

import zlib

import numpy as np

from paisoar_jax.errors import UserError

DIGITS_CLASSES = 10
DIGITS_LEVELS = 16  # the images hold grey levels 0..16
SYNTHETIC_POOL = 64  # distinct random images a synthetic source cycles through
SYNTHETIC_LENGTH = 1 << 20  # items per epoch of a synthetic source
SYNTHETIC_EVAL_LENGTH = 256  # a synthetic eval set is finite: every eval reads all of it


class Digits:
    """One split of scikit-learn's 1,797 handwritten 8 x 8 digits (UCI), as uint8 images."""

    augment = False

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels
        self.classes = [str(digit) for digit in range(DIGITS_CLASSES)]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"image": self.images[index], "label": int(self.labels[index])}


def open_digits(eval_fraction: float) -> tuple[Digits, Digits]:
    """(train, eval) digits; `eval_fraction` held out by a crc32 of each image's index."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UserError(
            "data.source=digits needs scikit-learn: pip install 'paisoar_jax[digits]'"
        ) from None
    digits = load_digits()
    images = np.round(digits.images * (255 / DIGITS_LEVELS)).astype(np.uint8)[..., None]
    labels = digits.target.astype(np.int32)
    buckets = np.array([zlib.crc32(str(i).encode()) % 10_000 for i in range(len(labels))])
    is_eval = buckets < eval_fraction * 10_000
    if eval_fraction > 0 and not is_eval.any():
        raise UserError(f"data.eval_fraction={eval_fraction} leaves no digits for eval")
    return (
        Digits(images[~is_eval], labels[~is_eval]),
        Digits(images[is_eval], labels[is_eval]),
    )


class SyntheticImages:
    """Random uint8 images with labels index % classes: a fixed pool, cycled (benchmarks)."""

    augment = False

    def __init__(
        self,
        image_size: int,
        channels: int,
        num_classes: int,
        seed: int,
        length: int = SYNTHETIC_LENGTH,
    ):
        self.length = length
        rng = np.random.default_rng(seed)
        shape = (SYNTHETIC_POOL, image_size, image_size, channels)
        self.pool = rng.integers(0, 256, shape, dtype=np.uint8)
        self.num_classes = num_classes
        self.classes = [str(label) for label in range(num_classes)]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        return {"image": self.pool[index % SYNTHETIC_POOL], "label": index % self.num_classes}
