"""The daemon's log as ``phi4 logs`` shows it: its last lines, then (``--follow``) what is added,
across a rotation; cleaned of control sequences, since it quotes requests and engine errors."""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import TextIO

from phi4cli.text.sanitize import TextCleaner


def show_log(path: Path, lines: int, follow: bool, out: TextIO) -> None:
    """Write the last ``lines`` lines of ``path`` to ``out``; with ``follow``, then each line as
    it is written (a rotated log is followed to its new file) until Ctrl-C."""
    cleaner = TextCleaner()  # the log quotes requests and engine errors: foreign text
    with path.open("rb") as handle:
        # More lines than a deque can count (it overflows past sys.maxsize) is every line.
        for line in deque(handle, maxlen=min(lines, sys.maxsize)) if lines else ():
            out.write(cleaner.feed(line.decode(errors="replace")))
        out.flush()
        if not follow:
            return
        inode = os.fstat(handle.fileno()).st_ino
        try:
            while True:
                chunk = handle.read()
                if chunk:
                    out.write(cleaner.feed(chunk.decode(errors="replace")))
                    out.flush()
                    continue
                time.sleep(0.2)
                if path.exists() and path.stat().st_ino != inode:  # rotated: follow the new one
                    handle.close()
                    handle = path.open("rb")
                    inode = os.fstat(handle.fileno()).st_ino
        except KeyboardInterrupt:
            return
