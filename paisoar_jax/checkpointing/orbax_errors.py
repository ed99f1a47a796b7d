"""How Orbax's failures reach the user: one line each, never a background thread's traceback.

A damaged checkpoint or export fails one of Orbax's reads; the error that says what is wrong
is tensorstore's, under Orbax's (`describe_damage`). Orbax's other reads of the same restore,
abandoned, are printed by the garbage collector, and a failed async save is logged from its
thread with a traceback: the loop and the readers report each failure in one line already,
so `quiet_orbax_leftovers` and `SAVE_THREAD_ERRORS` drop those repeats.
"""

from __future__ import annotations

import logging
import os
from typing import Any


def describe_failure(error: Exception) -> str:
    """`Type: first line of the message` (200 characters at most), for one-line reports."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def describe_damage(error: BaseException) -> str:
    """describe_failure of the error that says what is wrong (tensorstore's, under Orbax's)."""
    cause = error.__cause__ if isinstance(error.__cause__, Exception) else None
    return describe_failure(cause or error)


def _from_orbax(error_info: Any) -> bool:
    """Whether an exception's traceback runs through Orbax or tensorstore."""
    traceback = getattr(error_info, "__traceback__", None)
    while traceback is not None:
        filename = traceback.tb_frame.f_code.co_filename
        if f"{os.sep}orbax{os.sep}" in filename or "tensorstore" in filename:
            return True
        traceback = traceback.tb_next
    return False


def quiet_orbax_leftovers() -> None:
    """Drops what Orbax's abandoned reads print after a failed read (once per process).

    A damaged file fails one read; Orbax's other reads of the same restore are left to
    the garbage collector, which prints each ("Exception ignored in coroutine", "Event loop
    is closed": hundreds of lines). The failure itself is reported in one line.
    """
    import sys

    if getattr(sys.unraisablehook, "paisoar_jax", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        code = getattr(unraisable.object, "cr_code", None)
        orbax_coroutine = code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename
        closed_loop = isinstance(unraisable.exc_value, RuntimeError) and (
            "Event loop is closed" in str(unraisable.exc_value)
        )
        if not (orbax_coroutine or closed_loop or _from_orbax(unraisable.exc_value)):
            previous(unraisable)

    hook.paisoar_jax = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(
        lambda record: not (record.exc_info and _from_orbax(record.exc_info[1]))
    )


class SaveThreadErrors(logging.Filter):
    """Drops Orbax's log of an async save that failed in its thread, with the traceback.

    The same error reaches the loop at the next wait, which says it in one line and saves
    again (a vanished directory, run_directory.py): the traceback would only repeat it.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """False (dropped) for an Orbax record with an exception attached."""
        return not (f"{os.sep}orbax{os.sep}" in record.pathname and record.exc_info)


SAVE_THREAD_ERRORS = SaveThreadErrors()
