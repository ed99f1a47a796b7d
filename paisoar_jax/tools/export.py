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

from paisoar_jax.errors import UserError
from paisoar_jax.output import describe_params, note
from paisoar_jax.tools.cli import exit_status

PROGRAM = "paisoar_jax.export"


def export(
    run_dir: pathlib.Path, output: pathlib.Path, step: int | None = None, ema: bool = False
) -> int:
    """Writes the params of `step` (default: the newest) of the run in `run_dir` to `output`.

    `ema`: the step's moving average of the weights (train.ema_decay) as the params.
    """
    import math

    import jax

    from paisoar_jax.checkpoint import export_weights
    from paisoar_jax.config import dump_yaml

    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"--output {output} exists and is not an empty directory")
    config, path, step = checkpoint_step(run_dir, step)
    params, model_state = _load(path, ema)
    export_weights(params, model_state or {}, output)
    (output / "config.yaml").write_text(dump_yaml(config))
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    what = "the moving average of the weights" if ema else describe_params(count)
    note(f"{what} of step {step} -> {output}/params", program=PROGRAM)
    return step


def checkpoint_step(run_dir: pathlib.Path, step: int | None = None):
    """(the run's config, the directory of `step` or the newest complete step, the step)."""
    from paisoar_jax.checkpoint import checkpoint_directory
    from paisoar_jax.config import load_config

    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise UserError(f"{run_dir} is not a run directory (no config.yaml)")
    config = load_config(str(config_path))
    checkpoints = checkpoint_directory(config.checkpoint, run_dir)
    # Complete steps only: a save killed half-way leaves `<step>.orbax-checkpoint-tmp-*`.
    steps = sorted(int(path.name) for path in checkpoints.glob("[0-9]*") if path.name.isdigit())
    if not steps or (step is not None and step not in steps):
        wanted = f"step {step}" if step is not None else "a checkpoint"
        raise UserError(f"{checkpoints} has no {wanted} (steps: {steps or 'none'})")
    step = steps[-1] if step is None else step
    return config, checkpoints / str(step), step


def weights_source(source: pathlib.Path):
    """(config, the directory of the weights, what it is) for `source`.

    `source` is a params export, a checkpoint step directory (`runs/x/checkpoints/400`) or
    a run directory (its newest step).
    """
    from paisoar_jax.config import load_config

    run_config = source.parent.parent / "config.yaml"
    if (source / "state").is_dir() and run_config.is_file():
        return load_config(str(run_config)), source, f"checkpoint {source}"
    if (source / "params").is_dir() and (source / "config.yaml").is_file():
        return load_config(str(source / "config.yaml")), source, f"export {source}"
    if not source.is_dir():
        raise UserError(f"{source}: no such run, checkpoint step or export directory")
    config, path, step = checkpoint_step(source)
    return config, path, f"step {step} of {source}"


def read_weights(source: pathlib.Path):
    """(config, params, what was read) of an export, a checkpoint step or a run's newest."""
    config, path, where = weights_source(source)
    return config, _load(path)[0], where


def _load(path: pathlib.Path, ema: bool = False):
    """(params, model state) of an export or checkpoint step, on one device.

    `ema`: the params are the step's moving average of the weights.
    """
    import jax

    from paisoar_jax.checkpoint import abstract_weights, load_weights

    # The weights' shapes come from the checkpoint itself, so no model is rebuilt (a model
    # of one's own cannot be: only its factory knows it); one device holds them.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return load_weights(path, abstract_weights(path, device), ema)


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
