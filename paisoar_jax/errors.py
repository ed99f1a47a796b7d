"""The one exception type for bad user input.

Anything a user can get wrong (a config key, a mesh shape, a data path) raises `UserError`
with one line naming the culprit. Entrypoints print that line and exit with status 2
instead of a traceback; everything else is a bug and keeps its traceback.
"""

USER_ERROR_EXIT_CODE = 2
# No step finished within train.hang_timeout_s (watchdog.py): `launch --max-restarts` retries
# it, as it does a crash; a user error (2) it never retries.
HANG_EXIT_CODE = 3
# Ctrl-C (SIGINT) stopped the run after saving: 128 + SIGINT, as a shell reports it, so that
# `train && export` stops there. SIGTERM (a preemption) saves and exits 0.
INTERRUPTED_EXIT_CODE = 130


class UserError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


class DivergenceError(Exception):
    """The loss became non-finite without a loss scaler to absorb it: the run stops."""


class HangError(Exception):
    """The hang watchdog stopped the run (it saved first): exit status HANG_EXIT_CODE."""
