"""What the trackers share: the numeric fields of a record, the git commit, their packages."""

from __future__ import annotations

import pathlib
import subprocess
from typing import Any

from paisoar_jax.errors import UserError

DEFAULT_PROJECT = "paisoar_jax"  # the W&B project and MLflow experiment without run.project


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields but its step (booleans and text left out)."""
    return {
        key: value
        for key, value in record.items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    }


def git_commit(directory: pathlib.Path | None = None) -> str | None:
    """The commit checked out in `directory`'s repository (the working directory's), or None."""
    try:
        found = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() if found.returncode == 0 else None


def import_package(name: str, package: str):
    """The tracker's package, or one line naming the extra that installs it."""
    try:
        return __import__(package)
    except ImportError:
        raise UserError(
            f'run.trackers={name} needs the {name} package: pip install "paisoar-jax[{name}]"'
        ) from None


def first_line(error: Exception, limit: int | None = None) -> str:
    """`Kind: the first line of its message` (a tracker's own message leads with its cause)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:limit] if text else ''}"
