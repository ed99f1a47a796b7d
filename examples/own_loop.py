"""Your own training loop over the pieces `fit` uses: sharded, mixed precision, resumable.

    python examples/own_loop.py [section.key=value ...]   # e.g. precision.policy=bf16

`paisoar_jax.prepare` takes what `fit` takes and hands back the sharded state, the global
batches and the compiled step; the loop is yours, and each of fit's actions is one call:
a metrics.jsonl record (`log`), the whole held-out set evaluated as fit does (`evaluate`),
a save (`save`, asynchronous; a step already saved is left as it is), and a stop on SIGTERM
or Ctrl-C that every process agrees on (`should_stop`). Run it again and it resumes from
its last save, with the batch it would have seen; `paisoar_jax.load` reads its run
directory as it reads fit's.
"""

import sys

import numpy as np
from own_mlp import MLP, loss, spirals  # the model, loss and data of examples/own_mlp.py

import paisoar_jax

STEPS = 300

if __name__ == "__main__":
    settings = ["run.name=own_loop", "train.global_batch=64", "optim.lr=3e-3", *sys.argv[1:]]
    prepared = paisoar_jax.prepare(
        None, settings, model=MLP, loss=loss, data=spirals(4096, 0), eval_data=spirals(512, 2)
    )
    state = prepared.state
    steps = range(prepared.start_step + 1, STEPS + 1)
    for step, batch in zip(steps, prepared.batches(), strict=False):
        state, metrics = prepared.train_step(state, batch)
        stop = prepared.should_stop(step)  # a SIGTERM or Ctrl-C came: save, then leave
        if step % 50 == 0 or stop:
            prepared.log(step, metrics | prepared.evaluate(state, step))
        if step % 100 == 0 or step == STEPS or stop:
            prepared.save(state)
        if stop:
            break
    prepared.close()  # the last save committed, metrics.jsonl closed
    held_out = spirals(1000, 1)
    logits = np.asarray(prepared.model(state)(held_out["point"]))
    print(f"held-out accuracy {(logits.argmax(-1) == held_out['label']).mean():.3f}")
