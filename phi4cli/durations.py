"""Durations as people write them (``30m``, ``1h``, ``90s``, ``250ms``, a number of seconds) and
as phi4 shows them. A leaf: the config, the protocol and the daemon all read durations."""

from __future__ import annotations

import re

FOREVER = -1.0  # any negative duration: never

_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: object) -> float:
    """Return seconds for ``30m``, ``1h``, ``90s``, ``250ms`` or a number; any negative is forever.

    Raise ValueError when the value is none of those.
    """
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ValueError(value)
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return FOREVER if seconds < 0 else seconds


def format_duration(seconds: float) -> str:
    if seconds < 0:
        return "forever"
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"
