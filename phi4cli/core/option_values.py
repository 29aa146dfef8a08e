"""The values of settings: the parsers that turn a setting's text (config file, ``PHI4_*``
variable, flag, chat ``/set``) or its TOML value into its value, raising ValueError for what is
not allowed, and the limits they check against (llama.cpp's counts and seeds, the shortest
context). A leaf: the table of settings (``options``) names a parser in each row.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from phi4cli.core.durations import parse_duration

MIN_N_CTX = 64  # below this no question fits beside a system prompt (and llama.cpp may abort)
MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS
# The most any count of tokens, layers or requests may be: llama.cpp keeps them in int32.
MAX_COUNT = 2**31 - 1
# llama.cpp's seeds are uint32, and 2**32 - 1 there means "draw a random one".
MAX_SEED = 2**32 - 2
# Text of a number longer than this is refused before it is converted: no setting's range
# needs more, and int() stops at 4,300 digits with an error of its own.
_MAX_NUMBER_TEXT = 40


def whole_number(value: object, low: int, high: int) -> int:
    """Return ``value`` (an int, or text of one) as a whole number from ``low`` to ``high``.

    Raise ValueError for anything else (a bool, a fraction, text too long for any number in
    range), checked before it is converted: never OverflowError, nor int()'s digit limit.
    """
    if isinstance(value, (bool, float)):
        raise ValueError(value)
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip()
        if len(text) > _MAX_NUMBER_TEXT:
            raise ValueError(value)
        number = int(text)
    if not low <= number <= high:
        raise ValueError(value)
    return number


def real_number(value: object, low: float, high: float) -> float:
    """Return ``value`` (a number, or text of one) as a float from ``low`` to ``high``.

    Raise ValueError for anything else (a bool, inf, NaN, a 400-digit int, long text),
    checked before it is converted: never OverflowError.
    """
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, (int, float)):
        number: float = value
    else:
        text = str(value).strip()
        if len(text) > _MAX_NUMBER_TEXT:
            raise ValueError(value)
        number = float(text)
    if not low <= number <= high:  # NaN fails it too
        raise ValueError(value)
    return float(number)


def positive_int(value: object) -> int:
    return whole_number(value, 1, MAX_COUNT)


def up_to(high: int) -> Callable[[object], int]:
    """A parser for a whole number from 1 to ``high``."""

    def parse(value: object) -> int:
        return whole_number(value, 1, high)

    return parse


def optional_positive_int(value: object) -> int | None:
    if value is None or str(value).strip().lower() in {"", "none", "auto", "0"}:
        return None
    return positive_int(value)


def context_size(value: object) -> int | None:
    if value is None or str(value).strip().lower() in {"", "auto", "0"}:
        return None
    number = positive_int(value)
    if number < MIN_N_CTX:
        raise ValueError(value)
    return number


THREADS_ALLOWED = (  # what ``threads`` allows, in words
    f"auto, or from 1 to {min(MAX_THREADS, 4 * (os.cpu_count() or 1))} (4 per CPU of this machine)"
)


def threads(value: object) -> int | None:
    """Up to 4 threads per CPU of this machine (and ggml's 512): more only crash llama.cpp."""
    number = optional_positive_int(value)
    if number is not None and number > min(MAX_THREADS, 4 * (os.cpu_count() or 1)):
        raise ValueError(value)
    return number


def one_of(*choices: str) -> Callable[[object], str]:
    """A parser for a setting that is one of ``choices`` (any case)."""

    def parse(value: object) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(value)
        return text

    return parse


def gpu_layers(value: object) -> str | int:
    if isinstance(value, bool):
        raise ValueError(value)
    text = str(value).strip().lower()
    if text in ("auto", "all"):
        return text
    return whole_number(text, 0, MAX_COUNT)


def between(low: float, high: float) -> Callable[[object], float]:
    """A parser for a number from ``low`` to ``high``."""

    def parse(value: object) -> float:
        return real_number(value, low, high)

    return parse


def whole_or(word: str, high: int = MAX_COUNT) -> Callable[[object], int | None]:
    """A parser for a whole number from 0 to ``high``, or none (also said as ``word``:
    random, off)."""

    def parse(value: object) -> int | None:
        text = value.strip().lower() if isinstance(value, str) else value
        if text is None or text in ("", "none", word):
            return None
        return whole_number(value, 0, high)

    return parse


def whole_or_zero(value: object) -> int:
    """A whole number >= 0; none and off are 0."""
    return whole_or("off")(value) or 0


def positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(value)
    return seconds


def instruction(value: object) -> str | None:
    text = None if value is None else str(value).strip()
    return None if not text or text.lower() == "none" else text


def backend_urls(value: object) -> tuple[str, ...] | None:
    """One URL, or several (replicas of one model): a list (TOML, repeated --backend) or text
    with spaces or commas between them; each checked once, here, and kept in order without
    repeats."""
    items = value if isinstance(value, (list, tuple)) else [value]
    urls: list[str] = []
    for item in items:
        text = optional_str(item)
        if text is None or text.lower() == "none":
            continue
        for url in text.replace(",", " ").split():
            from urllib.parse import urlsplit

            parts = urlsplit(url)  # raises ValueError for a malformed one ("http://[::1")
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(value)
            if url not in urls:
                urls.append(url)
    return tuple(urls) or None


def boolean(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


def optional_str(value: object) -> str | None:
    text = None if value is None else str(value)
    return text or None
