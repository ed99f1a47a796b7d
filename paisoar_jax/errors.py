"""The one exception type for bad user input, and how a setting is named in its line.

Anything a user can get wrong (a config key, a mesh shape, a data path) raises `UserError`
(a ValueError) with one line naming the culprit. The command line prints that line and
exits with status 2 instead of a traceback, and so does a script that leaves one uncaught
(`end_uncaught`); everything else is a bug and keeps its traceback.
"""

import functools
import os
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

USER_ERROR_EXIT_CODE = 2
# No step finished within train.hang_timeout_s (watchdog.py): `launch --max-restarts` retries
# it, as it does a crash; a user error (2) it never retries.
HANG_EXIT_CODE = 3
# Ctrl-C (SIGINT) stopped the run after saving: 128 + SIGINT, as a shell reports it, so that
# `train && export` stops there. SIGTERM (a preemption) saves and exits 0.
INTERRUPTED_EXIT_CODE = 130
# Every exit status of a command, with its meaning (the docs site's reference prints it).
EXIT_STATUSES = {
    0: "done; or stopped by SIGTERM (a scheduler's preemption) after saving the step reached",
    1: "the run diverged: a non-finite loss or params with no loss scaler to absorb it",
    USER_ERROR_EXIT_CODE: "bad input: one line names it (a config key, a path, a mesh, ...)",
    HANG_EXIT_CODE: "the hang watchdog stopped a run whose steps stopped finishing (saved first)",
    INTERRUPTED_EXIT_CODE: "Ctrl-C: saved the step reached (or before the first step: nothing)",
    143: "SIGTERM before the first step finished: nothing new to save",
}


class UserError(ValueError):
    """Bad input from the user: one line; exit status 2 on the command line (or uncaught).

    A `ValueError`, so code that catches those catches it too.

    Args:
        message: the one line: what is wrong, naming the key, file or argument, and what
            would be right.

    Example:
        ```python
        import paisoar_jax

        try:
            paisoar_jax.fit(None, ["optim.lr=-1"])
        except paisoar_jax.UserError as error:
            print(error)  # optim.lr must be > 0, got -1.0
        ```

    """

    def __init__(self, message: str) -> None:
        super().__init__(message)


class DivergenceError(Exception):
    """The loss became non-finite without a loss scaler to absorb it: the run stops."""


class HangError(Exception):
    """The hang watchdog stopped the run (it saved first): exit status HANG_EXIT_CODE."""


class SettingNames:
    """How a tool names its settings in errors: convert's `--flag value` or a run's `key=value`.

    One conversion serves both doors (`convert text` and a run's `data.source=hf:`), and each
    error must name what the user typed there. `labels` maps a setting to its name (an
    empty one: the door has no such setting); a setting without a label is a flag spelled
    from its own name (record_tokens: --record-tokens).
    """

    def __init__(self, labels: dict[str, str] | None = None, joiner: str = " "):
        self.labels = labels or {}
        self.joiner = joiner  # between a name and its value

    def __call__(self, setting: str, value: object = None) -> str:
        """The setting's name, with `value` as the user would write it when given."""
        label = self.labels.get(setting) or "--" + setting.replace("_", "-")
        if value is None:
            return label
        # A label that already ends in its joiner (data.source=hf:) takes the value as is.
        return f"{label}{value}" if label.endswith(("=", ":")) else f"{label}{self.joiner}{value}"

    def offers(self, setting: str) -> bool:
        """Whether the user can set `setting` through this door."""
        return self.labels.get(setting) != ""


FLAG_NAMES = SettingNames()  # the command-line tools' own flags


_program = [""]  # the name an uncaught error's line gives (end_uncaught's last caller)


def end_uncaught(program: str) -> None:
    """An uncaught UserError, DivergenceError or HangError ends the program as the CLI does.

    Its one line goes to stderr and the exit status is 2, 1 or 3. A library call raises
    them, to be caught like any exception; a script that lets one escape gets that line
    instead of a traceback. Other exceptions keep Python's own hook.
    """
    _program[0] = program  # the outermost caller's name: it says it last
    previous = sys.excepthook
    if getattr(previous, "paisoar_jax", False):
        return

    def hook(kind, error, traceback) -> None:
        statuses = {UserError: USER_ERROR_EXIT_CODE, DivergenceError: 1, HangError: HANG_EXIT_CODE}
        status = next((code for known, code in statuses.items() if isinstance(error, known)), None)
        if status is None:
            previous(kind, error, traceback)
            return
        from paisoar_jax import output

        sys.stdout.flush()
        output.error(str(error), program=_program[0])
        sys.stderr.flush()
        os._exit(status)  # (the process is ending: no atexit waits on peers that wait on us)

    hook.paisoar_jax = True
    sys.excepthook = hook


def one_line_errors(program: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A public function whose UserError, left uncaught in a script, is one line and status 2.

    For the API's functions and methods that do not go through api.py's `_run` (token_windows,
    source_examples, Generator, a Prepared run's methods): the error is raised as always, to
    be caught like any exception; `end_uncaught` only decides how an uncaught one ends.
    """

    def wrap(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return function(*args, **kwargs)
            except (UserError, DivergenceError, HangError):
                end_uncaught(program)
                raise

        return call

    return wrap
