"""Values that shell completion offers: setting names, a setting's fixed values, and models
(aliases and ``.gguf`` files).

Completion runs on every Tab, so this reads only the config's tables and one directory listing:
no model is opened, no daemon asked.
"""

from __future__ import annotations

import os

from phi4cli.config import CHOICES, setting_help


def setting_keys(incomplete: str) -> list[str]:
    """The settings whose name starts with ``incomplete``. Without a description: Typer
    renders one through rich, which costs an import and wraps long ones across lines."""
    return [key for key, _env, _allowed in setting_help() if key.startswith(incomplete)]


def setting_values(key: str | None, incomplete: str) -> list[str]:
    """The values of setting ``key`` that start with ``incomplete``, where they are a fixed set
    (none for a number, a duration or text: the shell then offers nothing)."""
    return [value for value in CHOICES.get(key or "", ()) if value.startswith(incomplete)]


def models(incomplete: str) -> list[tuple[str, str]]:
    """The model aliases, ``.gguf`` files and directories that start with ``incomplete``."""
    from phi4cli.models import ALIASES

    found = [(name, alias.description) for name, alias in ALIASES.items()
             if name.startswith(incomplete)]  # fmt: skip
    directory, _, prefix = incomplete.rpartition("/")
    if directory == "" and incomplete.startswith("/"):
        directory = "/"
    listed = os.path.expanduser(directory) if directory else "."
    try:
        entries = sorted(os.scandir(listed), key=lambda entry: entry.name)
    except OSError:
        return found
    lead = "" if not directory else directory if directory.endswith("/") else directory + "/"
    for entry in entries:
        if not entry.name.startswith(prefix) or (entry.name.startswith(".") and not prefix):
            continue
        try:
            is_dir = entry.is_dir()
        except OSError:
            continue
        if is_dir:
            found.append((f"{lead}{entry.name}/", "directory"))
        elif entry.name.endswith(".gguf"):
            found.append((f"{lead}{entry.name}", "model file"))
    return found
