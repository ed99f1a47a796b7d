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

    Unguarded: no `if` around it tests `__name__` (`if __name__ == "__main__":`, with an
    `and` or inside a `try:` too; any test of it is taken as a guard, so that a guarded
    script is never refused). None otherwise, and without a script file that parses (an
    interactive session, `python -c`, a notebook).
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
        tree = ast.parse(pathlib.Path(path).read_bytes())  # its own encoding, BOM or not
    except (OSError, SyntaxError, ValueError):
        return None  # nothing to read: no advice rather than a wrong one
    line = frame.f_lineno
    statements = tree.body
    while statements:
        around = [one for one in statements if one.lineno <= line <= (one.end_lineno or 0)]
        if not around:
            break
        statement = around[0]
        if isinstance(statement, ast.If) and _tests_name(statement.test):
            return None
        statements = [
            child for child in ast.iter_child_nodes(statement) if isinstance(child, ast.stmt)
        ] + [
            inner
            for child in ast.iter_child_nodes(statement)
            if isinstance(child, ast.excepthandler | ast.match_case)
            for inner in child.body
        ]
    return pathlib.Path(path), line


def _tests_name(test: ast.expr) -> bool:
    """Whether an `if` test reads `__name__` (the main guard, alone or within a condition)."""
    return any(isinstance(node, ast.Name) and node.id == "__name__" for node in ast.walk(test))
