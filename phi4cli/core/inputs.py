"""Text that comes in (arguments, stdin, files, typed lines, saved chats) checked for what cannot
be sent on as UTF-8, before any daemon is started for it.

Python keeps bytes that are not UTF-8 as lone surrogates (U+DC80 to U+DCFF, in arguments, in the
environment, in prompt-toolkit's input), and a JSON file may spell one out (``"\\ud800"``).
Either fails only when the request is encoded, long after the command began: so it is found
here, and named in one line that says where (the argument, stdin line N, FILE line N).
"""

from __future__ import annotations

import re
from typing import TextIO

from phi4cli.core.errors import UsageError

_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"  # what a bad byte is shown as, where input is read with replacement
HOW_TO_FIX = "convert it to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)"


def describe(char: str) -> str:
    """A bad character as the user would know it: the byte it was, or the surrogate it is."""
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape's spelling of one byte
        return f"byte 0x{code - 0xDC00:02x}"
    return f"a lone surrogate U+{code:04X}"


def find_bad(text: str) -> re.Match[str] | None:
    """The first character of ``text`` that cannot be encoded as UTF-8, if any."""
    return _SURROGATE.search(text)


# The way to a value inside decoded JSON: a dict's key (str) or a list's index (int) a step.
JsonPath = tuple[str | int, ...]


def find_unencodable(value: object) -> tuple[JsonPath, bool] | None:
    """Where the first string of a decoded JSON value (in document order) holds what UTF-8
    cannot encode (a lone surrogate, as JSON's ``"\\ud800"`` makes one): its path, and whether
    it is a key of the dict at that path rather than the value there. None if every string is
    text. Iterative: a value's depth is bounded only by whoever parsed it."""
    stack: list[tuple[JsonPath, object, bool]] = [((), value, False)]
    while stack:
        path, item, is_key = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and find_bad(item):
                return path, is_key
        elif isinstance(item, dict):
            for key, inner in reversed(list(item.items())):  # popped in order: key, then value
                stack.append(((*path, key), inner, False))
                stack.append((path, key, True))
        elif isinstance(item, list):
            stack.extend(((*path, i), inner, False) for i, inner in reversed(list(enumerate(item))))
    return None


def check_text(text: str, where: str) -> str:
    """Return ``text``; raise UsageError naming ``where`` when it is not valid UTF-8 text."""
    bad = find_bad(text)
    if bad is not None:
        line = text.count("\n", 0, bad.start()) + 1
        at = f" line {line}" if "\n" in text else ""
        raise UsageError(f"{where}{at} is not valid UTF-8 ({describe(bad.group())}): {HOW_TO_FIX}")
    return text


def decode(data: bytes, where: str) -> str:
    """``data`` decoded as UTF-8; raise UsageError naming ``where`` and the line when it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UsageError(
            f"{where} line {line} is not valid UTF-8 (byte 0x{data[exc.start]:02x}): {HOW_TO_FIX}"
        ) from None


def read_all(stream: TextIO, where: str = "stdin") -> str:
    """The whole of a text stream, checked: its bytes when it has them (sys.stdin's decoder
    would fail mid-read, or let bad bytes through as surrogates), else its text."""
    raw = getattr(stream, "buffer", None)
    if raw is not None:
        return decode(raw.read(), where)
    return check_text(stream.read(), where)


def replace_bad(text: str) -> tuple[str, bool]:
    """``text`` with each character that is not valid UTF-8 replaced by U+FFFD, and whether any
    was."""
    replaced, count = _SURROGATE.subn(REPLACEMENT, text)
    return replaced, bool(count)


def join_words(words: list[str] | tuple[str, ...] | None) -> str | None:
    """The question given as arguments: several words joined with single spaces, as
    ``ollama run`` and ``llm`` do (``phi4 solve what is 2+2``); None when none was given.

    A lone ``-`` stays ``-`` (read stdin); a ``-`` among words is just a word, and a question
    given as words leaves stdin alone."""
    return " ".join(words) if words else None
