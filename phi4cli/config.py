"""Settings: defaults < ``config.toml`` < environment (``PHI4_*``) < command-line flags.

What the settings are (parser, default, variable, option, ...) is ``options.SETTINGS``, the one
table of them; this module reads their values. The result is one frozen :class:`Settings`;
every other module reads settings from it and nothing else reads the config file. phi4's
own environment variables are read here too: each setting's (:func:`env_name`), and the few
that are no setting (:data:`VARIABLES`, through :func:`variable`); a test keeps any other
module from reading a ``PHI4_`` variable itself. The platform's variables (``HOME``, ``XDG_*``,
``TERM``, ``NO_COLOR``, ``EDITOR``) are read where they are used, and listed in
:data:`VARIABLES` for the docs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from phi4cli._settings import Settings as Settings
from phi4cli.durations import FOREVER as FOREVER
from phi4cli.durations import format_duration as format_duration
from phi4cli.durations import parse_duration as parse_duration
from phi4cli.errors import ConfigError, UsageError
from phi4cli.options import ANSWER_KEYS as ANSWER_KEYS
from phi4cli.options import CHOICES as CHOICES
from phi4cli.options import DAEMON_SETTINGS as DAEMON_SETTINGS
from phi4cli.options import DEFAULT_INSTRUCTION as DEFAULT_INSTRUCTION
from phi4cli.options import DEFAULT_MODEL as DEFAULT_MODEL
from phi4cli.options import SETTING, SETTINGS, env_name
from phi4cli.records import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_FIELDS = SETTING  # key -> its row: parser, allowed values, ...


def setting_help() -> list[tuple[str, str, str]]:
    """Return (key, environment variable, allowed values) for every setting, in table order,
    the same on every machine (for generated docs)."""
    return [(s.key, env_name(s.key), s.doc_allowed or s.allowed) for s in SETTINGS]


class Variable(Record):
    """Environment variables phi4 reads that are no setting, and what they mean (the docs')."""

    names: tuple[str, ...]
    help: str


VARIABLES = (
    Variable(("PHI4_HOME",), "Put every phi4 file under this directory (config, data, state, "
             "cache, run)."),
    Variable(("PHI4_RAMDISK",), "Directory to stage the model in (default /dev/shm/phi4-UID)."),
    Variable(("PHI4_BACKEND_KEY",), "API key sent to the --backend server (Authorization: "
             "Bearer)."),
    Variable(("PHI4_API_KEY",), "The key phi4 serve --http requires, as --api-key."),
    Variable(("PHI4_HTTP_HEADER_TIMEOUT", "PHI4_HTTP_BODY_TIMEOUT"), "Seconds an HTTP client of "
             "phi4 serve has to send its headers (10) and its body (30)."),
    Variable(("PHI4_DEBUG",), "Show tracebacks with errors."),
    Variable(("NO_COLOR",), "No colour at a terminal; bold, the live line and the layout stay."),
    Variable(("VISUAL", "EDITOR"), "The editor of phi4 config edit."),
    Variable(("HF_ENDPOINT",), "Hugging Face endpoint used by phi4 pull."),
)  # fmt: skip
_DECLARED = {name for variable_ in VARIABLES for name in variable_.names}


def variable(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of a declared environment variable (:data:`VARIABLES`), None when unset."""
    assert name in _DECLARED, f"{name} is not declared in config.VARIABLES"
    return (os.environ if environ is None else environ).get(name)


def set_in_environment(key: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether setting ``key`` is given by its ``PHI4_*`` variable."""
    return env_name(key) in (os.environ if environ is None else environ)


def parse_setting(key: str, value: object, source: str) -> Any:
    """Return ``value`` parsed for setting ``key``; raise ConfigError naming ``source`` and
    ``key`` (a long value shown by its start and length)."""
    setting = _FIELDS[key]
    try:
        return setting.parse(value)
    except (TypeError, ValueError, OverflowError):  # the parsers check ranges first; a guard
        raise ConfigError(
            f"{source}: invalid {key} {_shown(value)}: expected {setting.allowed}"
        ) from None


def _shown(value: object) -> str:
    """``value`` as an error shows it: its repr, only the start of a long one (a list of one
    value, as a repeated option gives it, as that value)."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python converts (4,300)
        return "(a number of over 4,300 digits)"
    return text if len(text) <= 80 else f"{text[:64]}... ({len(text):,} characters)"


def read_config_file(path: Path) -> dict[str, Any]:
    """Return the parsed config file ({} when absent); raise ConfigError naming bad keys, or
    saying why a file another user could have written is not read (``read_user_file``)."""
    from phi4cli.atomicfile import RefusedFileError, read_user_file

    try:
        raw = read_user_file(path, "config file")
    except FileNotFoundError:
        return {}  # no config file: no TOML parser to import either
    except RefusedFileError as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    import tomllib

    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file (TOML); fix or remove it") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    except ValueError:  # tomllib's int() of a number of over 4,300 digits
        raise ConfigError(f"{path}: {_long_number(raw)}") from None
    if "backends" in data:  # the plural reads better for a list of replicas
        if "backend" in data:
            raise ConfigError(f"{path}: give backend or backends, not both")
        data["backend"] = data.pop("backends")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ConfigError(
            f"{path}: unknown key {unknown[0]!r}; known keys: {', '.join(sorted(_FIELDS))}"
        )
    return data


def _long_number(raw: bytes) -> str:
    """What to say of a config file holding an integer too long for Python to read, naming the
    key it is given to when that can be told."""
    import re

    said = "holds a number of over 4,300 digits, more than any setting allows"
    text = raw.decode(errors="replace")
    found = re.search(r"^\s*([A-Za-z0-9_-]{1,40})\s*=\s*[+-]?[0-9_]{4300}", text, re.MULTILINE)
    return f"invalid {found[1]}: it {said}" if found else f"the file {said}"


def load_settings(
    config_file: Path,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Merge defaults, the config file, ``PHI4_*`` variables and non-None flag overrides."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for key, value in read_config_file(config_file).items():
        values[key] = parse_setting(key, value, str(config_file))
    for key in Settings._fields:
        name = env_name(key)
        if name in environ:
            values[key] = parse_setting(key, environ[name], name)
    for key, value in (overrides or {}).items():
        if value is not None and value != () and value != []:  # () : a repeatable flag not given
            values[key] = parse_setting(key, value, f"--{key.replace('_', '-')}")
    return Settings(**values)


def setting_sources(
    config_file: Path, environ: Mapping[str, str] | None = None
) -> dict[str, tuple[Any, str]]:
    """Return each setting's effective value and where it comes from (default, file, env)."""
    environ = os.environ if environ is None else environ
    settings = load_settings(config_file, {}, environ)
    in_file = read_config_file(config_file)
    sources: dict[str, tuple[Any, str]] = {}
    for key in Settings._fields:
        name = env_name(key)
        source = name if name in environ else str(config_file) if key in in_file else "default"
        sources[key] = (getattr(settings, key), source)
    return sources


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    import json

    return json.dumps(str(value), ensure_ascii=False)  # JSON strings are TOML basic strings


def set_config_value(config_file: Path, key: str, value: str) -> Any:
    """Validate ``value`` for ``key`` and write it to the config file (atomically); return the
    parsed value. ``none`` clears an optional setting. Raise ConfigError naming the key."""
    from phi4cli.atomicfile import write_atomic

    if key not in _FIELDS:
        raise ConfigError(f"unknown key {key!r}; known keys: {', '.join(sorted(_FIELDS))}")
    parsed = parse_setting(key, value, f"config key {key}")
    data = read_config_file(config_file)
    if parsed is None:
        data.pop(key, None)
    else:
        # Durations keep the user's spelling ("30m"); everything else its parsed form.
        data[key] = value if key == "keep_alive" else parsed
    line = None if parsed is None else f"{key} = {_toml_value(data[key])}\n"
    text = _edited(config_file, key, line, data)
    if text is None:  # not one plain line to change: the file written afresh, sorted
        text = "".join(f"{name} = {_toml_value(data[name])}\n" for name in sorted(data))
    try:
        write_atomic(config_file, text.encode(), mode=0o644, what="config file")
    except OSError as exc:  # a full disk, say: not a usage error
        from phi4cli.errors import Phi4Error

        raise Phi4Error(f"cannot write {config_file}: {exc.strerror}; nothing changed") from None
    return parsed


def _edited(config_file: Path, key: str, line: str | None, data: dict[str, Any]) -> str | None:
    """The config file with ``key``'s one line replaced by ``line`` (or removed when None, or
    added at the end when absent), so that the user's comments and order are kept; None when
    that edit would not read back as ``data`` (a value over several lines, a table)."""
    import re
    import tomllib

    try:
        lines = config_file.read_text(encoding="utf-8").splitlines(keepends=True)
    except (OSError, UnicodeDecodeError):
        return None
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
    text = "".join(lines)
    try:
        read = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError):
        return None
    if "backends" in read and "backend" not in read:
        read["backend"] = read.pop("backends")
    return text if read == data else None


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

    from phi4cli.atomicfile import RefusedFileError, read_user_file, write_atomic

    try:
        text = read_user_file(path, "config file")
    except RefusedFileError as exc:
        raise ConfigError(str(exc)) from None
    except FileNotFoundError:
        text = b"# phi4 settings: see `phi4 config show` for the keys\n"
    # The editor works on a copy beside the file (as visudo and crontab -e do), so an invalid
    # edit never becomes the config that every later command refuses to start with.
    draft = path.with_name(f".{path.name}.edit.toml")
    write_atomic(draft, text, mode=0o600, what="config file's draft")
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
        write_atomic(path, read_user_file(draft, "config file's draft"), mode=0o644,
                     what="config file")  # fmt: skip
    finally:
        draft.unlink(missing_ok=True)


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

    from phi4cli.options import DAEMON_START

    try:
        # A long whole number is kept as its text, which the table's parser refuses naming its
        # key (json's own int() would stop at 4,300 digits with a bare ValueError).
        values = json.loads(given, parse_int=lambda text: int(text) if len(text) < 40 else text)
    except ValueError:
        values = None
    if not isinstance(values, dict) or not set(values) <= set(DAEMON_START):
        raise UsageError(f"--settings must be a JSON object of {', '.join(DAEMON_START)}")
    checked: dict[str, Any] = {key: parse_setting(key, value, "--settings")
                               for key, value in values.items()}  # fmt: skip
    return settings._replace(**checked)
