"""What every entry point does once its config is loaded, before it touches a device.

The command-line tools (cli.py `run`) and `paisoar_jax.fit` call `start`, so a run
begins the same way from either door, in this order:

1. absl's flags are marked parsed: grain's worker processes read them, and once jax is
   imported they count as unparsed (a worker would then fail on its first batch).
2. `zoo.check_model`: what needs a zoo model's own tables (an image variant's shape, fp8
   blocks, a stack that pipelines) is refused in one line, before every rank joins.
3. `platform.choose_platform`: the CPU where jax's CUDA plugin has no driver to use.
4. `distributed.initialize`: a multi-process run joins its peers (the launcher's, SLURM's,
   Open MPI's or torchrun's variables), before anything asks for devices.
"""

from __future__ import annotations

from paisoar_jax.config import Config
from paisoar_jax.runtime import distributed, heartbeat, platform


def start(config: Config, program: str) -> None:
    """Readies this process for `config`'s run; `program` names it in start-up errors."""
    settings = config.checkpoint  # what a signal from here on names as saved (preemption.py)
    directory = settings.dir or config.run_dir / "checkpoints"  # (checkpoint_directory's)
    heartbeat.progress.checkpoint_dir = str(directory) if settings.enabled else None
    import absl.flags

    absl.flags.FLAGS.mark_as_parsed()
    # Imported here: a bad key or `--help` answers before the model libraries load.
    from paisoar_jax.tasks.zoo import check_model

    check_model(config.model, config.mesh, config.train, config.precision.policy)
    platform.choose_platform()
    distributed.initialize(config.distributed, program=program)
