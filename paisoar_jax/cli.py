"""What every `python -m paisoar_jax.*` entrypoint shares: argument parsing and exit codes."""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable, Sequence

from paisoar_jax import output
from paisoar_jax.config import Config, load_config
from paisoar_jax.config.keys import keys_help
from paisoar_jax.errors import (
    HANG_EXIT_CODE,
    INTERRUPTED_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    DivergenceError,
    HangError,
    UserError,
)
from paisoar_jax.run.startup import start
from paisoar_jax.runtime import distributed, heartbeat, platform
from paisoar_jax.runtime.preemption import StopRequest


def config_parser(program: str, description: str) -> argparse.ArgumentParser:
    """A parser for `[--config FILE.yaml] [section.key=value ...]`; --help lists the keys."""
    parser = argparse.ArgumentParser(
        prog=program,
        description=description,
        epilog=keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        default=None,
        help="a YAML file, or the name of a shipped config (default: the embedded tiny GPT)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="e.g. optim.lr=1e-3 mesh.fsdp=2"
    )
    return parser


def run(
    main: Callable[[Config], object],
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
) -> int:
    """Parses the config and runs `main`; bad input becomes one line and exit status 2."""
    args = parser.parse_intermixed_args(argv)

    def work() -> object:
        config = load_config(args.config, args.overrides)
        start(config, parser.prog)  # as fit starts (startup.py)
        return main(config)

    try:
        # From here a signal ends the process at once (128 + its number) until a run's own
        # StopRequest takes over at its start (preemption.py): no KeyboardInterrupt lost in
        # a library's callback, no wait for a distributed start-up or a compile.
        with StopRequest():
            return exit_status(parser.prog, work)
    except KeyboardInterrupt:  # Ctrl-C before a run caught it (preemption.py): nothing saved
        output.error(
            "interrupted (Ctrl-C) before the first step: nothing saved", program=parser.prog
        )
        return INTERRUPTED_EXIT_CODE


def exit_status(program: str, work: Callable[[], object]) -> int:
    """Runs `work`; a UserError is one line and status 2, a divergence one line and status 1.

    A hang the watchdog stopped (after saving) is one line and status 3; a run Ctrl-C
    stopped (after saving: its summary says `stopped_by` SIGINT) exits 130. The platform is
    chosen first (runtime/platform.py), before `work` starts jax's backends.
    """
    platform.choose_platform()
    try:
        result = work()
    except (UserError, DivergenceError, HangError) as error:
        output.error(str(error), program=program)
        # Under the launcher: which rank failed first, and whether a restart could help.
        heartbeat.record_failure(str(error), retryable=not isinstance(error, DivergenceError))
        status = (
            USER_ERROR_EXIT_CODE
            if isinstance(error, UserError)
            else HANG_EXIT_CODE
            if isinstance(error, HangError)
            else 1
        )
    except Exception as error:
        heartbeat.record_failure(heartbeat.one_line(error))
        if not distributed.joined():
            raise
        traceback.print_exc()  # a bug keeps its traceback
        status = 1
    else:
        interrupted = isinstance(result, dict) and result.get("stopped_by") == "SIGINT"
        return INTERRUPTED_EXIT_CODE if interrupted else 0
    if distributed.joined():  # a failed process must not wait for the others at exit
        distributed.exit_now(status)
    return status
