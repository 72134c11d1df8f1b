"""Argument checks that name the knob and the allowed values."""

import math


def check_int(name: str, value, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")


def check_number(name: str, value, allowed: str, ok) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not ok(value)
    ):
        raise ValueError(f"{name} must be a number in {allowed}; got {value!r}")
