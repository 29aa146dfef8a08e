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

Linear in the text, no backtracking: a character-class search finds the next character of
interest and a small state machine walks the sequences. ``TextCleaner`` keeps that state
between the chunks of a stream, so a sequence split across two tokens is still caught.

Light on purpose: the client path of ``phi4 solve`` imports this (``re`` only).
"""

from __future__ import annotations

import re

REPLACEMENT = "\ufffd"

# Every character that starts something to clean; anything else is copied as it is.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

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


# In a JSON text these can only stand inside strings, and `json.dumps(ensure_ascii=False)`
# writes them raw: a terminal reads a raw U+009B as CSI. As \uXXXX escapes the JSON decodes to
# the same value. Lone surrogates, which cannot be encoded, are escaped the same way.
_JSON_ESCAPES = {
    code: f"\\u{code:04x}"
    for code in (
        *range(0x7F, 0xA0),
        *range(0x202A, 0x202F),
        *range(0x2066, 0x206A),
        *range(0xD800, 0xE000),
    )
}


def json_safe(json_text: str) -> str:
    """Return a JSON text (from ``json.dumps(..., ensure_ascii=False)``) with DEL, C1, bidi
    controls and lone surrogates written as ``\\uXXXX`` escapes: still valid JSON, same value."""
    return json_text.translate(_JSON_ESCAPES)
