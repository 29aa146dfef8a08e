"""Writing the config file and reading the daemon's start: ``phi4 config set`` (one line
changed, the file's comments and order kept), ``phi4 config edit`` (a draft checked before it
replaces the file), and ``phi4 daemon run --settings`` (a client's settings, each checked). Apart
from config.py, which every command reads: none of this is on a ``phi4 solve``'s path."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phi4cli.core.config import (
    Settings,
    config_from_bytes,
    parse_setting,
    read_config_bytes,
    read_config_file,
)
from phi4cli.core.errors import ConfigError, UsageError
from phi4cli.core.options import SETTING as _FIELDS


def _toml_value(value: object) -> str:
    if isinstance(value, (list, tuple)):  # the backend's replicas
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    import json

    return json.dumps(str(value), ensure_ascii=False)  # JSON strings are TOML basic strings


def _as_toml(value: Any) -> Any:
    """A parsed value as the config file holds it (and TOML reads it back)."""
    if isinstance(value, tuple):
        return value[0] if len(value) == 1 else list(value)
    return value


def set_config_value(config_file: Path, key: str, value: str) -> Any:
    """Validate ``value`` for ``key`` and write it to the config file (atomically); return the
    parsed value. ``none`` clears an optional setting. Raise ConfigError naming the key."""
    key = setting_key(key)
    parsed = parse_setting(key, value, f"config key {key}")
    _write_key(config_file, key, value, parsed)
    return parsed


def unset_config_value(config_file: Path, key: str) -> bool:
    """Remove ``key`` from the config file (atomically), so that it takes its default again (or
    its environment variable's value); False if the file did not set it. Raise ConfigError for
    an unknown key."""
    key = setting_key(key)
    raw = read_config_bytes(config_file)
    if raw is None or key not in config_from_bytes(raw, config_file):
        return False
    _write_key(config_file, key, "", None)
    return True


def setting_key(key: str) -> str:
    """``key`` as Settings names it (``backends``, the plural a file may use, is ``backend``);
    ConfigError for a key phi4 does not have."""
    key = "backend" if key == "backends" else key
    if key not in _FIELDS:
        raise ConfigError(f"unknown key {key!r}; known keys: {', '.join(sorted(_FIELDS))}")
    return key


def _write_key(config_file: Path, key: str, value: str, parsed: Any) -> None:
    """Write ``key`` (its ``value`` as typed, ``parsed``) into the config file, or remove it
    (``parsed`` None), changing only its line where it is one plain line."""
    raw = read_config_bytes(config_file)  # read once: parsed here, edited below
    data = config_from_bytes(raw, config_file) if raw is not None else {}
    if parsed is None:
        data.pop(key, None)
    else:
        # Durations keep the user's spelling ("30m"); replicas are a list (one URL, a string);
        # everything else its parsed form.
        data[key] = value if key == "keep_alive" else _as_toml(parsed)
    line = None if parsed is None else f"{key} = {_toml_value(data[key])}\n"
    text = _edited(raw.decode("utf-8") if raw is not None else "", config_file, key, line, data)
    if text is None:  # not one plain line to change: the file written afresh, sorted
        text = "".join(f"{name} = {_toml_value(data[name])}\n" for name in sorted(data))
    _write_config(config_file, text.encode(), 0o644, "config file", config_file)


def _edited(
    text: str, config_file: Path, key: str, line: str | None, data: dict[str, Any]
) -> str | None:
    """The config file's ``text`` with ``key``'s one line replaced by ``line`` (or removed when
    None, or added at the end when absent), so that the user's comments and order are kept;
    None when that edit would not read back as ``data`` (a value over several lines, a
    table)."""
    import re

    lines = text.splitlines(keepends=True)
    names = ("backend", "backends") if key == "backend" else (key,)
    pattern = re.compile(rf"\s*(?:{'|'.join(names)})\s*=")
    hits = [number for number, text in enumerate(lines) if pattern.match(text)]
    if len(hits) > 1:
        return None
    if hits:
        if line is not None:
            line = line.rstrip("\n") + _comment_of(lines[hits[0]]) + "\n"
        lines[hits[0] : hits[0] + 1] = [line] if line is not None else []
    elif line is not None:
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        lines.append(line)
    edited = "".join(lines)
    try:
        read = config_from_bytes(edited.encode("utf-8"), config_file)  # as the file will be read
    except ConfigError:
        return None
    return edited if read == data else None


def _comment_of(line: str) -> str:
    """The comment at the end of a ``key = value  # comment`` line (with the spaces before it),
    or "": the first ``#`` before which the line reads as TOML (one inside a string does not)."""
    import tomllib

    for at, char in enumerate(line):
        if char == "#":
            try:
                tomllib.loads(line[:at])
            except tomllib.TOMLDecodeError:
                continue
            start = len(line[:at].rstrip())
            return line[start:].rstrip("\n")
    return ""


def edit_config(path: Path, editor: str, say: Callable[[str], None]) -> None:
    """Open a copy of the config file in ``editor`` and put it in place once it checks out; at
    a terminal a bad edit can be edited again, elsewhere it is refused (ConfigError) and the
    file stays as it was."""
    import shlex
    import subprocess
    import sys

    from phi4cli.core.atomicfile import RefusedFileError, read_user_file

    try:
        text = read_user_file(path, "config file")
    except RefusedFileError as exc:
        raise ConfigError(str(exc)) from None
    except FileNotFoundError:
        text = b"# phi4 settings: see `phi4 config show` for the keys\n"
    # The editor works on a copy beside the file (as visudo and crontab -e do), so an invalid
    # edit never becomes the config that every later command refuses to start with.
    draft = path.with_name(f".{path.name}.edit.toml")
    _write_config(draft, text, 0o600, "config file's draft", path)
    try:
        while True:
            subprocess.run([*shlex.split(editor), str(draft)], check=False)
            try:
                check_config_file(draft, shown_as=path)
                break
            except ConfigError as exc:
                if not (sys.stdin.isatty() and sys.stderr.isatty()):
                    raise ConfigError(f"{exc}; {path} is unchanged") from None
                say(str(exc))
                answer = input("Edit again? [Y/n] ").strip().lower()
                if answer.startswith("n"):
                    raise ConfigError(f"{path} is unchanged") from None
        _write_config(
            path, read_user_file(draft, "config file's draft"), 0o644, "config file", path
        )
    finally:
        with contextlib.suppress(OSError):  # (a read-only disk, where none was made)
            draft.unlink(missing_ok=True)


def _write_config(target: Path, data: bytes, mode: int, what: str, config_file: Path) -> None:
    """Write ``target`` atomically; raise UnwritableError (a full disk), saying that
    ``config_file`` is as it was."""
    from phi4cli.core.atomicfile import UnwritableError, write_atomic

    try:
        write_atomic(target, data, mode=mode, what=what)
    except OSError as exc:
        raise UnwritableError(target, what, exc, detail=f"; {config_file} is unchanged") from None


def check_config_file(config_file: Path, shown_as: Path | None = None) -> None:
    """Raise ConfigError unless every key and value in the file is valid; the error names
    ``shown_as`` (the real file, when a draft of it is checked)."""
    try:
        data = read_config_file(config_file)
    except ConfigError as exc:
        if shown_as is None:
            raise
        raise ConfigError(str(exc).replace(str(config_file), str(shown_as))) from None
    for key, value in data.items():
        parse_setting(key, value, str(shown_as or config_file))


def started_with(given: str, settings: Settings) -> Settings:
    """``settings`` with those of ``--settings`` (JSON, from ``spawn.daemon_command``), each
    checked as its row of options.SETTINGS says (null: "auto", for those that have one)."""
    import json

    from phi4cli.core.options import DAEMON_START

    try:
        # A long whole number is kept as its text, which the table's parser refuses naming its
        # key (json's own int() would stop at 4,300 digits with a bare ValueError).
        values = json.loads(given, parse_int=lambda text: int(text) if len(text) < 40 else text)
    except ValueError:
        values = None
    if not isinstance(values, dict) or not set(values) <= set(DAEMON_START):
        raise UsageError(f"--settings must be a JSON object of {', '.join(DAEMON_START)}")
    checked: dict[str, Any] = {
        key: parse_setting(key, value, "--settings") for key, value in values.items()
    }
    return settings._replace(**checked)
