"""What the public API accepts as a length of time in seconds (internal).

A tool's ``timeout`` and a sweeper's ``interval`` both refuse the same
values, in the same way: this says once what a positive number of seconds is.
"""

from __future__ import annotations

import math

__all__ = ["is_positive_seconds"]


def is_positive_seconds(value: object) -> bool:
    """Whether ``value`` is a finite int or float above 0; a bool is not a number of
    seconds, though Python counts it as an int."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )
