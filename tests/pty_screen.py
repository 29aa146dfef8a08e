"""Running ``phi4`` with a pseudo-terminal for stdout and stderr, and reading what it showed."""

from __future__ import annotations

import io
import os
import re

import pexpect


def plain(screen: str) -> str:
    """The screen's text: phi4's own CSI styling and cursor moves, and the pty's CRs, taken out."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen).replace("\r", "")


def in_pty(
    command: str, args: list[str], env: dict[str, str] | None = None, width: int = 120
) -> str:
    """``command args`` run with stdout and stderr a terminal (exit 0 asserted): what it
    showed there."""
    child = pexpect.spawn(
        command,
        args,
        encoding="utf-8",
        dimensions=(40, width),
        timeout=90,
        env={**os.environ, **(env or {})},
    )
    child.expect(pexpect.EOF)
    child.close()
    screen = str(child.before)
    assert child.exitstatus == 0, screen
    return screen


def chat_in_pty(
    command: str, args: list[str], steps: list[tuple[str, str]], width: int = 120
) -> str:
    """``command args`` (a chat) run at a terminal: wait for its greeting, then for each
    (line, text) of ``steps`` send the line and wait for the text; leave with /exit (exit 0
    asserted). Return all it showed."""
    child = pexpect.spawn(command, args, encoding="utf-8", dimensions=(40, width), timeout=90)
    child.logfile_read = transcript = io.StringIO()
    child.expect_exact("Ctrl-D to leave")
    for line, text in steps:
        child.sendline(line)
        child.expect_exact(text)
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    screen = transcript.getvalue()
    assert child.exitstatus == 0, screen
    return screen
