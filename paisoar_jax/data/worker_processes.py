"""Grain's worker processes (data.workers > 0) import the main script again.

Python starts them with `spawn`: each runs the script from the top under the name
`__mp_main__`. A script that calls `paisoar_jax.fit` at its top level, outside an
`if __name__ == "__main__":` block, would start a second training run in every worker; each
then finds the first run's lock on run.dir and exits, and grain reports only that a worker
died. `check_main_guard` finds that case before any worker starts and says what to change.
"""

from __future__ import annotations

import ast
import pathlib
import sys

from paisoar_jax.errors import UserError


def check_main_guard(workers: int) -> None:
    """UserError when workers > 0 and the main script's running line is unguarded."""
    if workers <= 0:
        return
    found = unguarded_main_line()
    if found is not None:
        path, line = found
        raise UserError(
            f"data.workers={workers} starts worker processes that import your script again, "
            f"and {path.name} line {line} runs at its top level: put it under "
            f'`if __name__ == "__main__":` (or set data.workers=0)'
        )


def unguarded_main_line() -> tuple[pathlib.Path, int] | None:
    """(the main script, its top-level line now running) when that line is unguarded.

    Unguarded: outside an `if __name__ == "__main__":` block. None otherwise, and without
    a script file (an interactive session, `python -c`, a notebook).
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None:
        return None
    frame = sys._getframe()
    while frame is not None and not (
        frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"
    ):
        frame = frame.f_back
    if frame is None:
        return None
    try:
        tree = ast.parse(pathlib.Path(path).read_text())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None  # nothing to read: no advice rather than a wrong one
    line = frame.f_lineno
    for statement in tree.body:
        if statement.lineno <= line <= (statement.end_lineno or statement.lineno):
            return None if _is_main_guard(statement) else (pathlib.Path(path), line)
    return None


def _is_main_guard(statement: ast.stmt) -> bool:
    """Whether `statement` is `if __name__ == "__main__":` (either side of the ==)."""
    if not isinstance(statement, ast.If) or not isinstance(statement.test, ast.Compare):
        return False
    test = statement.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [side.id for side in sides if isinstance(side, ast.Name)]
    constants = [side.value for side in sides if isinstance(side, ast.Constant)]
    return names == ["__name__"] and constants == ["__main__"]
