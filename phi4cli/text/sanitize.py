"""Cleaning foreign text (a model's, a remote engine's, a saved file's) before it reaches a
terminal or a pipe, so that it can only ever be read, never obeyed.

What a terminal would act on is replaced by one visible ``�`` (U+FFFD), so a reader sees that
something was there:

- an escape sequence, whole: ESC followed by CSI (``ESC [`` … final byte), OSC, DCS, SOS, PM or
  APC (``ESC ] 52;c;… BEL`` and the like, up to their terminator or the end of the line), a
  two-character or nF escape; and the C1 forms of the same (U+009B CSI, U+009D OSC, …);
- any other C0 control character but newline and tab, DEL, C1 (U+0080-U+009F);
- a carriage return not followed by a newline (``\\r\\n`` becomes ``\\n``);
- the bidi overrides and isolates (U+202A-U+202E, U+2066-U+2069), which reorder what is shown.

What a terminal would not show at all (zero-width spaces and joiners, LRM and RLM, the BOM, tag
characters: ``_INVISIBLE``) is kept by the cleaner, as sent, for a pipe; at a terminal
``terminal_text`` writes each as ``<U+200B>``, as ``less`` does. ``TerminalStream``, around every
stream that is a terminal, passes all that is written to it through ``terminal_text``: the last
guard, which also catches what a renderer made of the text after it was cleaned (rich's Markdown
decodes ``&#x202e;`` into U+202E).

Linear in the text, no backtracking: a character-class search finds the next character of
interest and a small state machine walks the sequences. ``TextCleaner`` keeps that state
between the chunks of a stream, so a sequence split across two tokens is still caught.

Light on purpose: the client path of ``phi4 solve`` imports this (``re`` only, and the
``functools`` that ``re`` imports itself).
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any, TextIO

REPLACEMENT = "\ufffd"

_BIDI = "\u202a-\u202e\u2066-\u2069"  # the overrides and isolates, as a character class
# Every character that starts something to clean; anything else is copied as it is.
_UNSAFE = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}]")

_NORMAL, _ESCAPE, _CSI, _STRING, _STRING_ESCAPE, _NF, _CR = range(7)

# After ESC: the byte that opens a control string (OSC, DCS, SOS, PM, APC) and its C1 forms.
_STRING_OPENERS = frozenset("]PX^_")
_C1_STRINGS = frozenset("\x90\x98\x9d\x9e\x9f")
_BEL, _ESC, _ST = "\x07", "\x1b", "\x9c"


class TextCleaner:
    """Clean a stream of text chunk by chunk: ``feed`` each chunk, ``flush`` at its end."""

    def __init__(self) -> None:
        self._state = _NORMAL

    def feed(self, text: str) -> str:
        """Return the cleaned text of this chunk (a sequence may continue into the next)."""
        if self._state == _NORMAL and _UNSAFE.search(text) is None:
            return text
        out: list[str] = []
        index, end = 0, len(text)
        while index < end:
            state = self._state
            if state == _NORMAL:
                found = _UNSAFE.search(text, index)
                if found is None:
                    out.append(text[index:])
                    break
                start = found.start()
                out.append(text[index:start])
                index = start + 1
                self._start(text[start], out)
                continue
            char = text[index]
            code = ord(char)
            consumed = True
            if state == _CR:
                self._state = _NORMAL
                out.append("\n" if char == "\n" else REPLACEMENT)
                consumed = char == "\n"
            elif state == _ESCAPE:
                if char == "[":
                    self._state = _CSI
                elif char in _STRING_OPENERS:
                    self._state = _STRING
                elif 0x20 <= code <= 0x2F:
                    self._state = _NF
                else:
                    self._state = _NORMAL
                    consumed = 0x30 <= code <= 0x7E  # a two-character escape (ESC c, ESC 7, …)
            elif state == _CSI:
                if 0x40 <= code <= 0x7E:
                    self._state = _NORMAL
                elif not 0x20 <= code <= 0x3F:
                    self._state, consumed = _NORMAL, False  # broken off: look at it afresh
            elif state == _NF:
                if not 0x20 <= code <= 0x2F:
                    self._state = _NORMAL
                    consumed = 0x30 <= code <= 0x7E
            elif state == _STRING:
                if char in (_BEL, _ST):
                    self._state = _NORMAL
                elif char == _ESC:
                    self._state = _STRING_ESCAPE
                elif char == "\n":
                    # Ended at the line's end, so an unterminated string cannot swallow the
                    # rest of the text; what follows is plain text again.
                    self._state, consumed = _NORMAL, False
            elif state == _STRING_ESCAPE:
                self._state = _NORMAL
                consumed = char == "\\"  # ESC \ is the string terminator; else a new sequence
                if not consumed:
                    self._start(_ESC, out)
            if consumed:
                index += 1
        return "".join(out)

    def _start(self, char: str, out: list[str]) -> None:
        """Handle one character that ``_UNSAFE`` found, in the normal state."""
        if char == "\r":
            self._state = _CR  # shown once the next character says whether it ends a line
            return
        out.append(REPLACEMENT)
        if char == _ESC:
            self._state = _ESCAPE
        elif char == "\x9b":
            self._state = _CSI
        elif char in _C1_STRINGS:
            self._state = _STRING

    def flush(self) -> str:
        """Return what the end of the stream settles (a carriage return left pending)."""
        pending = REPLACEMENT if self._state == _CR else ""
        self._state = _NORMAL
        return pending


def clean_text(text: str) -> str:
    """Return ``text`` with every control sequence and character replaced as the module says."""
    cleaner = TextCleaner()
    return cleaner.feed(text) + cleaner.flush()


# Invisible: the format characters (Unicode category Cf) other than the bidi controls, the line
# and paragraph separators, and the other default-ignorable code points that stand alone (Hangul
# fillers, unassigned ones); not the variation selectors and combining marks, which attach to a
# visible character (an emoji's U+FE0F). A test checks this against the interpreter's Cf.
_INVISIBLE = (
    "\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u115f\u1160\u180e\u200b-\u200f"
    "\u2028\u2029\u2060-\u2065\u206a-\u206f\u3164\ufeff\uffa0\ufff0-\ufffb\U000110bd\U000110cd"
    "\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e00ff"
    "\U000e01f0-\U000e0fff"
)
# C1 and bidi controls are cleaned before any text is shown; here they are a second line: a
# renderer may have decoded them from an entity. C0 and ESC are not: they are phi4's own styling.
_AT_TERMINAL = f"[\x80-\x9f{_BIDI}{_INVISIBLE}]"


@cache
def _compiled(pattern: str) -> re.Pattern[str]:
    """``pattern`` compiled on first use: a command that writes no JSON, or nothing to a
    terminal, does not pay for it."""
    return re.compile(pattern)


def _shown(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code <= 0x9F or 0x202A <= code <= 0x202E or 0x2066 <= code <= 0x2069:
        return REPLACEMENT
    return f"<U+{code:04X}>"


def terminal_text(text: str) -> str:
    """Return ``text`` as a terminal may show it: C1 and bidi controls one U+FFFD each, every
    invisible character as ``<U+XXXX>``. Per character, with no state: escape sequences are
    ``clean_text``'s, and phi4's own (its styling) pass."""
    pattern = _compiled(_AT_TERMINAL)
    if pattern.search(text) is None:
        return text
    return pattern.sub(_shown, text)


class TerminalStream:
    """A stream that is a terminal, with everything written to it passed through
    ``terminal_text``; anything else (``fileno``, ``isatty``, ``flush``, ``buffer``) is the
    stream's own. Bytes written to its ``buffer`` pass unseen: prompt-toolkit draws the input
    line that way."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(terminal_text(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_terminal(stream: TextIO) -> TextIO:
    """Return ``stream`` as a ``TerminalStream`` (once: a guarded stream is returned as it is)."""
    if isinstance(stream, TerminalStream):
        return stream
    return TerminalStream(stream)  # type: ignore[return-value]  # a TextIO but for its name


# In a JSON text these can only stand inside strings, and `json.dumps(ensure_ascii=False)`
# writes them raw: a terminal reads a raw U+009B as CSI, and shows no invisible character. As
# \uXXXX escapes the JSON decodes to the same value. Lone surrogates, which cannot be encoded,
# are escaped the same way.
_JSON_UNSAFE = f"[\x7f-\x9f{_BIDI}\ud800-\udfff{_INVISIBLE}]"


def _json_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code > 0xFFFF:  # as a surrogate pair, as JSON writes a character beyond the BMP
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


def json_safe(json_text: str) -> str:
    """Return a JSON text (from ``json.dumps(..., ensure_ascii=False)``) with DEL, C1, bidi
    controls, invisible characters and lone surrogates written as ``\\uXXXX`` escapes: still
    valid JSON, same value."""
    pattern = _compiled(_JSON_UNSAFE)
    if pattern.search(json_text) is None:
        return json_text
    return pattern.sub(_json_escape, json_text)
