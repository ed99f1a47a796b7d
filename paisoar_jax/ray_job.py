"""The command line's run as Ray Train's `train_loop_per_worker` (runtime/ray_train.py).

Give `train_loop` to JaxTrainer with `train_loop_config={"args": [...]}`.
"""

from __future__ import annotations

from collections.abc import Sequence


def train_loop(config: dict[str, Sequence[str]]) -> None:
    """Runs `python -m paisoar_jax.train` with `config["args"]` in a Ray Train worker.

    run.dir defaults to the run directory on RunConfig's storage. A run that fails raises,
    so Ray's FailureConfig may start the workers again: they resume from its newest
    checkpoint.
    """
    from paisoar_jax import train
    from paisoar_jax.runtime import ray_train

    args = list(config.get("args", ()))
    if not any(arg.startswith("run.dir=") for arg in args):
        args.append(f"run.dir={ray_train.run_dir()}")
    status = train.main(args)
    if status:
        raise RuntimeError(f"paisoar_jax.train ended with status {status}")
