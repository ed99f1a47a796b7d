"""`python -m paisoar_jax.export RUN_DIR --output DIR [--step N]`: weights only, for inference.

Reads the run's config.yaml and a checkpoint (the newest, or --step), and writes the
params (and BatchNorm's running statistics, for models that have them) without the
optimizer state to DIR/params, with the run's config beside them. The export is the input of
inference code and of fine-tuning: `python -m paisoar_jax.train checkpoint.init_from=DIR`
starts a new run from these params with a fresh optimizer.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

from paisoar_jax.cli import exit_status
from paisoar_jax.errors import UserError
from paisoar_jax.output import describe_params, note

PROGRAM = "paisoar_jax.export"


def export(
    run_dir: pathlib.Path, output: pathlib.Path, step: int | None = None, ema: bool = False
) -> int:
    """Writes the params of `step` (default: the newest) of the run in `run_dir` to `output`.

    `ema`: the step's moving average of the weights (train.ema_decay) as the params.
    """
    import math

    import jax

    from paisoar_jax.checkpointing.weights import checkpoint_step, export_weights, read_params
    from paisoar_jax.config import dump_yaml

    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"--output {output} exists and is not an empty directory")
    config, path, step = checkpoint_step(run_dir, step)
    params, model_state = read_params(path, ema)
    export_weights(params, model_state or {}, output)
    (output / "config.yaml").write_text(dump_yaml(config))
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    what = "the moving average of the weights" if ema else describe_params(count)
    note(f"{what} of step {step} -> {output}/params", program=PROGRAM)
    return step


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__)
    parser.add_argument("run_dir", type=pathlib.Path, help="a run directory (holds config.yaml)")
    parser.add_argument("--output", type=pathlib.Path, required=True, help="where to write")
    parser.add_argument("--step", type=int, default=None, help="default: the newest checkpoint")
    parser.add_argument(
        "--ema", action="store_true", help="the moving average of the weights (train.ema_decay)"
    )
    args = parser.parse_args(argv)
    return exit_status(parser.prog, lambda: export(args.run_dir, args.output, args.step, args.ema))


if __name__ == "__main__":
    sys.exit(main())
