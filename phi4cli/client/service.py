"""The systemd user unit that runs the daemon at login (``phi4 daemon install-service``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from phi4cli.text.sanitize import clean_text


def unit_text(model_path: Path, keep_alive: str, home: str | None) -> str:
    """The unit: its description names the model, its command runs this Python's phi4 daemon
    with ``PHI4_HOME`` when one is set, each word quoted as systemd reads it back."""
    environment = f"Environment={_unit_word(f'PHI4_HOME={home}')}\n" if home is not None else ""
    described = _unit_word(
        f"phi4 daemon: {model_path.name} kept resident for phi4 solve and chat", quote=False
    )
    command = " ".join(
        _unit_word(word)
        for word in (
            sys.executable,
            "-m",
            "phi4cli",
            "daemon",
            "run",
            "--model",
            str(model_path),
            "--keep-alive",
            keep_alive,
        )
    )
    return (
        "[Unit]\n"
        f"Description={described}\n\n"
        "[Service]\n"
        "Type=simple\n"
        f"{environment}"
        f"ExecStart={command}\n"
        "Restart=on-failure\n\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )


def _unit_word(value: str, quote: bool = True) -> str:
    """``value`` as a systemd unit file reads it back: ``%`` doubled (a specifier otherwise), no
    line break, and (with ``quote``) in double quotes when it holds a space, a quote or a
    backslash, so that a path with a space stays one argument."""
    value = clean_text(value).replace("\n", " ").replace("%", "%%")
    if quote and re.search(r'[\s"\'\\;]', value):
        value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value
