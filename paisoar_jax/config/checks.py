"""The value checks the config sections share: each failure is one `UserError` line."""

from __future__ import annotations

import math
import re

from paisoar_jax.errors import UserError


def check_at_least(section: str, owner: object, minimums: dict[str, int]) -> None:
    """Each named count of `owner` must be at least its minimum."""
    for key, minimum in minimums.items():
        value = getattr(owner, key)
        if value < minimum:
            raise UserError(f"{section}.{key} must be >= {minimum}, got {value}")


def check_finite_non_negative(section: str, owner: object, keys: tuple[str, ...]) -> None:
    """Each named number of `owner` must be finite and >= 0."""
    for key in keys:
        value = getattr(owner, key)
        if value is not None and (not math.isfinite(value) or value < 0):  # None: unset
            raise UserError(f"{section}.{key} must be a finite number >= 0, got {value}")


def check_regex(pattern: str, key: str) -> None:
    """A regex of a config key must compile."""
    try:
        re.compile(pattern)
    except re.error as error:
        raise UserError(f"{key}: {pattern!r} is not a valid regex ({error})") from None
