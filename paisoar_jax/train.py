"""`python -m paisoar_jax.train [--config FILE.yaml] [section.key=value ...]`.

With no arguments it trains the embedded default: a tiny GPT on the Python standard
library's source, byte-level, on whatever devices jax sees.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from paisoar_jax import cli
from paisoar_jax.config import Config


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = cli.config_parser("paisoar_jax.train", "Train a model as one YAML config says.")
    return cli.run(_train, parser, argv)


def _train(config: Config) -> object:
    # Imported once the config has loaded: `--help` and a bad key answer in a second, before
    # the model libraries (several seconds of imports) start up.
    from paisoar_jax.run.loop import run

    return run(config).summary


if __name__ == "__main__":
    sys.exit(main())
