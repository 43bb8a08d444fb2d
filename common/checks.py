"""The value checks every config and request struct runs: each failure a ValueError that names its field."""

from __future__ import annotations

import math


def is_int(value: object) -> bool:
    """An int that is not a bool (True is an int in Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def require(ok: bool, key: str, expected: str, value: object) -> None:
    """ValueError("<key>: must be <expected>, got <value>") unless `ok`."""
    if not ok:
        raise ValueError(f"{key}: must be {expected}, got {value!r}")
