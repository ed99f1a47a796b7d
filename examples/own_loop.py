"""Your own training loop over the pieces `fit` uses: sharded, mixed precision, resumable.

    python examples/own_loop.py [section.key=value ...]   # e.g. precision.policy=bf16

`paisoar_jax.prepare` takes what `fit` takes and hands back the sharded state, the global
batches and the compiled step; the loop and its actions (what to log, when to save) are
yours. Run it again and it resumes from its last save, with the batch it would have seen.
"""

import sys

import numpy as np
from own_mlp import MLP, loss, spirals  # the model, loss and data of examples/own_mlp.py

import paisoar_jax

STEPS = 300

if __name__ == "__main__":
    settings = ["run.name=own_loop", "train.global_batch=64", "optim.lr=3e-3", *sys.argv[1:]]
    prepared = paisoar_jax.prepare(None, settings, model=MLP, loss=loss, data=spirals(4096, 0))
    state = prepared.state
    steps = range(prepared.start_step + 1, STEPS + 1)
    for step, batch in zip(steps, prepared.batches(), strict=False):
        state, metrics = prepared.train_step(state, batch)
        if step % 50 == 0:
            print(f"step {step}: loss {float(metrics['loss']):.4f}", flush=True)
            prepared.save(state)
    prepared.close()
    held_out = spirals(1000, 1)
    logits = np.asarray(prepared.model(state)(held_out["point"]))
    print(f"held-out accuracy {(logits.argmax(-1) == held_out['label']).mean():.3f}")
