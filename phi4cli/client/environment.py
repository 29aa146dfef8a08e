"""The Environment a command runs in (httpie's pattern): its streams, whether they are terminals,
whether colour is wanted, and where its files live. Commands and presenters read these from here,
never from ``sys`` or ``os.environ`` directly, so tests swap in their own."""

from __future__ import annotations

import os
import sys
from typing import TextIO

from phi4cli.client.exits import Announce, notice_line, say
from phi4cli.core.paths import Paths, get_paths
from phi4cli.text.sanitize import guard_terminal


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _devnull(writing: bool) -> TextIO:
    return open(os.devnull, "w") if writing else open(os.devnull)  # lives as long as the command


class Environment:
    def __init__(
        self,
        stdin: TextIO | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        *,
        stdin_isatty: bool | None = None,  # None: ask the stream
        stdout_isatty: bool | None = None,
        stderr_isatty: bool | None = None,
        colour: bool | None = None,  # None: unless NO_COLOR is set or TERM=dumb
        paths: Paths | None = None,
        raw_output: bool = False,
    ) -> None:
        # A stream closed when the command started (`>&-`) is None in sys: read nothing from it,
        # and write to nowhere, as to a reader that went away.
        self.stdin = stdin or sys.stdin or _devnull(False)
        self.stdout = stdout or sys.stdout or _devnull(True)
        self.stderr = stderr or sys.stderr or _devnull(True)
        self.stdin_isatty = _isatty(self.stdin) if stdin_isatty is None else stdin_isatty
        self.stdout_isatty = _isatty(self.stdout) if stdout_isatty is None else stdout_isatty
        self.stderr_isatty = _isatty(self.stderr) if stderr_isatty is None else stderr_isatty
        # Whatever is written to a terminal passes the last guard against hidden and reordered
        # text (sanitize.TerminalStream); a pipe keeps the invisible characters as sent.
        if self.stdout_isatty:
            self.stdout = guard_terminal(self.stdout)
        if self.stderr_isatty:
            self.stderr = guard_terminal(self.stderr)
        if colour is None:
            colour = not os.environ.get("NO_COLOR") and os.environ.get("TERM", "") != "dumb"
        self.colour = colour
        self.raw_output = raw_output
        self._paths = paths  # None: found on first use, where a bad PHI4_HOME is reported
        self._told: set[str] = set()  # what notice_once has said
        # Set while a live display (a progress bar) holds stderr's last line: it prints notices
        # above itself, where a plain write would land on its line.
        self.print_above_live: Announce | None = None

    @property
    def paths(self) -> Paths:
        """Where phi4's files live (``get_paths()`` unless given)."""
        if self._paths is None:
            self._paths = get_paths()
        return self._paths

    @property
    def terminal(self) -> bool:
        """A person reads stdout: spinners, Markdown, live status (coloured unless NO_COLOR)."""
        return self.stdout_isatty and os.environ.get("TERM", "") != "dumb"

    @property
    def raw_stdout(self) -> bool:
        """Model text goes to stdout unchanged (``--raw-output``): only when it is no terminal."""
        return self.raw_output and not self.stdout_isatty

    def stdout_gone(self) -> None:
        """The reader of stdout went away (``| head -1``): point stdout at /dev/null, so that
        the flush at exit is quiet. A stream with no file under it has nothing to point."""
        try:
            fd = self.stdout.fileno()
        except (OSError, ValueError):  # io.UnsupportedOperation is both
            return
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)

    def notice_once(self, message: str) -> None:
        """``notice``, unless this message was said already by this command."""
        if message not in self._told:
            self._told.add(message)
            self.notice(message)

    def notice(self, message: str) -> None:
        """One line for the user on stderr, prefixed ``phi4:`` (above a live progress bar);
        foreign text in it is cleaned."""
        if self.print_above_live is not None:
            self.print_above_live(notice_line(message))
        else:
            say(message, file=self.stderr)
