"""Your own grain input pipeline: you read, augment, shard and batch; paisoar_jax trains.

    python examples/own_grain_pipeline.py [section.key=value ...]

A grain IterDataset of ready batches is passed as `data`. Each process builds its own share
(`[process_index::process_count]`) and batches it to global_batch / process_count rows; the
pipeline's iterator state is saved with every checkpoint, so a resumed run on the same
process count carries on with exactly the batches the uninterrupted run would have seen.
(Give a grain MapDataset of examples instead and paisoar_jax's global sampler does the
sharing, shuffling and batching itself, in one order for any process count.)
"""

import sys

import grain
import jax
import numpy as np
from own_mlp import MLP, loss, spirals

import paisoar_jax

GLOBAL_BATCH = 64


class Jitter(grain.transforms.RandomMap):
    """Augmentation: a small random shift of each point (seeded per example by grain)."""

    def random_map(self, example, rng: np.random.Generator):
        """The example with its point moved by a little Gaussian noise."""
        shifted = example["point"] + rng.normal(0, 0.02, 2).astype(np.float32)
        return {"point": shifted, "label": example["label"]}


def pipeline(arrays: dict[str, np.ndarray], seed: int, train: bool) -> grain.IterDataset:
    """Per-process batches: this process's rows, shuffled each epoch, jittered, batched."""
    pairs = zip(arrays["point"], arrays["label"], strict=True)
    rows = [{"point": point, "label": label} for point, label in pairs]
    dataset = grain.MapDataset.source(rows)[jax.process_index() :: jax.process_count()]
    if train:
        dataset = dataset.shuffle(seed=seed).repeat(None).random_map(Jitter(), seed=seed)
    dataset = dataset.batch(GLOBAL_BATCH // jax.process_count(), drop_remainder=True)
    return dataset.to_iter_dataset()


if __name__ == "__main__":
    paisoar_jax.initialize()  # before jax.process_index(): joins a multi-process launch
    summary = paisoar_jax.fit(
        None,
        [
            "run.name=own_grain",
            "train.steps=200",
            f"train.global_batch={GLOBAL_BATCH}",
            "train.log_every=50",
            "train.eval_every=100",
            *sys.argv[1:],
        ],
        model=lambda rngs: MLP(rngs),
        loss=loss,
        data=pipeline(spirals(4096, seed=0), seed=0, train=True),
        eval_data=pipeline(spirals(512, seed=1), seed=1, train=False),
    )
    if "eval_accuracy" in summary:  # not when stopped early (Ctrl-C saves; rerun resumes)
        print(f"eval accuracy {summary['eval_accuracy']:.3f}")
