"""The Environment a command runs in (httpie's pattern): its streams, whether they are terminals,
whether colour is wanted, and where its files live. Commands and presenters read these from here,
never from ``sys`` or ``os.environ`` directly, so tests swap in their own."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TextIO

from phi4cli.paths import Paths, get_paths


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@dataclass
class Environment:
    stdin: TextIO = field(default_factory=lambda: sys.stdin)
    stdout: TextIO = field(default_factory=lambda: sys.stdout)
    stderr: TextIO = field(default_factory=lambda: sys.stderr)
    stdin_isatty: bool | None = None  # None: ask the stream
    stdout_isatty: bool | None = None
    stderr_isatty: bool | None = None
    # NO_COLOR set, or TERM=dumb: plain text even at a terminal.
    colour: bool = field(
        default_factory=lambda: (
            not os.environ.get("NO_COLOR") and os.environ.get("TERM", "") != "dumb"
        )
    )
    paths: Paths = field(default_factory=get_paths)

    def __post_init__(self) -> None:
        if self.stdin_isatty is None:
            self.stdin_isatty = _isatty(self.stdin)
        if self.stdout_isatty is None:
            self.stdout_isatty = _isatty(self.stdout)
        if self.stderr_isatty is None:
            self.stderr_isatty = _isatty(self.stderr)

    @property
    def terminal(self) -> bool:
        """A person reads stdout: colour, spinners, Markdown, live status."""
        return bool(self.stdout_isatty) and self.colour

    def notice(self, message: str) -> None:
        """One line for the user on stderr, prefixed ``phi4:``."""
        print(f"phi4: {message}", file=self.stderr, flush=True)
