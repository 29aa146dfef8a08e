"""The keyboard while an answer streams, in ``phi4 chat`` (from Enter to the next prompt) and in
``phi4 solve`` at a terminal: nothing typed is echoed into the answer, Ctrl-C stays a SIGINT,
and Enter while the model thinks asks for the answer now (:class:`AnswerNow`; the thinking
policy closes the thinking, docs/thinking.md#answer-now)."""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Callable
from typing import Any

from phi4cli.core.protocol import Event, EventKind

# What the live thinking line says of the key (``thinking… 3.2 s · 120 tokens · Enter: ...``).
ANSWER_NOW_HINT = "Enter: answer now"


class AnswerKeys:
    """The keyboard while an answer streams: nothing typed is echoed into it, Ctrl-C stops it.

    From Enter to the next prompt the terminal is put in non-canonical mode without echo, with
    signals on, so Ctrl-C is a SIGINT whenever it is pressed. A Ctrl-C typed so soon after
    Enter that the prompt still read it as a key (prompt-toolkit keeps such keys for the next
    prompt) or the terminal queued it as a byte counts as well. Every other key typed from
    Enter to the next prompt is discarded — typed blind, it would otherwise land in the next
    question unseen — except Enter while the model thinks, which :meth:`enter` reports.
    """

    def __init__(self, fd: int, prompt_input: Any = None) -> None:
        self.fd = fd
        self.prompt_input = prompt_input  # prompt-toolkit's Input, whose typeahead is checked
        self._saved: list[Any] | None = None

    def begin(self) -> bool:
        """Quiet the keyboard; return True if a Ctrl-C was typed already."""
        import termios

        interrupted = self._typeahead_has_ctrl_c()
        try:
            self._saved = termios.tcgetattr(self.fd)
        except (termios.error, OSError):
            self._saved = None
            return interrupted
        mode = [*self._saved[:6], list(self._saved[6])]
        mode[3] = (mode[3] & ~(termios.ECHO | termios.ICANON)) | termios.ISIG
        mode[6][termios.VMIN], mode[6][termios.VTIME] = 0, 0
        with contextlib.suppress(termios.error, OSError):
            termios.tcsetattr(self.fd, termios.TCSANOW, mode)
        return b"\x03" in self._drain() or interrupted

    def end(self) -> None:
        """Discard what was typed, and give the terminal back as it was."""
        import termios

        self._typeahead_has_ctrl_c()  # and forget the rest of it
        if self._saved is None:
            return
        self._drain()
        with contextlib.suppress(termios.error, OSError):
            termios.tcsetattr(self.fd, termios.TCSANOW, self._saved)
        self._saved = None

    def enter(self) -> bool:
        """Whether Enter was pressed since the last look (the other keys are discarded);
        never waits. False while the keyboard is not quieted (:meth:`begin` failed)."""
        if self._saved is None:
            return False
        typed = self._drain()
        return b"\r" in typed or b"\n" in typed

    def _typeahead_has_ctrl_c(self) -> bool:
        if self.prompt_input is None:
            return False
        from prompt_toolkit.input.typeahead import get_typeahead
        from prompt_toolkit.keys import Keys

        return any(press.key == Keys.ControlC for press in get_typeahead(self.prompt_input))

    def _drain(self) -> bytes:
        """Read what the terminal holds, without waiting."""
        data = b""
        with contextlib.suppress(OSError, ValueError):
            while select.select([self.fd], [], [], 0)[0]:
                chunk = os.read(self.fd, 4096)
                if not chunk:
                    break
                data += chunk
        return data


def terminal_keys(stdin: Any) -> AnswerKeys | None:
    """Keys for ``stdin`` where it is a terminal this process may read and set: ours in the
    foreground (a background job that touched it would be stopped, SIGTTIN or SIGTTOU); else
    None."""
    try:
        fd = stdin.fileno()
        if not os.isatty(fd) or os.tcgetpgrp(fd) != os.getpgrp():
            return None
    except (AttributeError, OSError, ValueError):
        return None
    return AnswerKeys(fd)


class AnswerNow:
    """Enter while the model thinks asks for the answer now, once: ``ask()`` (the stream's or
    the flight's ``answer_now``), then ``told()`` (the presenter's line says so). Looked at
    with each event: a key pressed before the thinking began (typed ahead) or after it ended
    is discarded."""

    def __init__(self, keys: AnswerKeys, ask: Callable[[], None], told: Callable[[], None]) -> None:
        self.keys, self.ask, self.told = keys, ask, told
        self.thinking = False  # the model thinks: reasoning came, no answer yet
        self.asked = False

    def see(self, event: Event) -> None:
        kind = event.kind
        if kind in (EventKind.TOKEN, EventKind.RETRACT) or kind.terminal:
            self.thinking = False
        pressed = self.keys.enter()  # (read at every event, so earlier keys are discarded)
        if kind == EventKind.REASONING:
            if not self.thinking:  # its first piece: what was typed before it is not for it
                self.thinking = True
                return
            if pressed and not self.asked:
                self.asked = True
                self.ask()
                self.told()
