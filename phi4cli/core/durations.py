"""Durations as people write them (``30m``, ``1h``, ``90s``, ``250ms``, a number of seconds) and
as phi4 shows them. A leaf: the config, the protocol and the daemon all read durations."""

from __future__ import annotations

import re
import sys

FOREVER = -1.0  # -1: never

_DURATION = re.compile(r"^\s*(-?\d{1,30}(?:\.\d{1,30})?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: object) -> float:
    """Return seconds for ``30m``, ``1h``, ``90s``, ``250ms`` or a number of seconds (finite);
    -1 (in any unit: ``-1m``, as ollama takes it) is :data:`FOREVER`.

    Raise ValueError for anything else: another negative, inf, NaN, a bool, a number no float
    holds (checked before it is converted, so never OverflowError).
    """
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, (int, float)):
        number, unit = value, 1.0
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ValueError(value)
        number, unit = float(match.group(1)), _UNIT_SECONDS[match.group(2)]
    if number == -1:
        return FOREVER
    # Compared before float() and the unit: an int of 400 digits does not fit a float.
    if not 0 <= number <= sys.float_info.max / unit:
        raise ValueError(value)  # NaN fails the comparison too
    return float(number) * unit


def format_duration(seconds: float) -> str:
    if seconds < 0:
        return "forever"
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"
