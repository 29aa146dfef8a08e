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
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from phi4cli.core._settings import Settings as Settings
from phi4cli.core.durations import FOREVER as FOREVER
from phi4cli.core.durations import format_duration as format_duration
from phi4cli.core.durations import parse_duration as parse_duration
from phi4cli.core.errors import ConfigError
from phi4cli.core.options import ANSWER_KEYS as ANSWER_KEYS
from phi4cli.core.options import CHOICES as CHOICES
from phi4cli.core.options import DAEMON_SETTINGS as DAEMON_SETTINGS
from phi4cli.core.options import DEFAULT_INSTRUCTION as DEFAULT_INSTRUCTION
from phi4cli.core.options import DEFAULT_MODEL as DEFAULT_MODEL
from phi4cli.core.options import SETTING, SETTINGS, env_name

_FIELDS = SETTING  # key -> its row: parser, allowed values, ...


def setting_help() -> list[tuple[str, str, str]]:
    """Return (key, environment variable, allowed values) for every setting, in table order,
    the same on every machine (for generated docs)."""
    return [(s.key, env_name(s.key), s.doc_allowed or s.allowed) for s in SETTINGS]


class Variable(NamedTuple):
    """Environment variables phi4 reads that are no setting, and what they mean (the docs')."""

    names: tuple[str, ...]
    help: str


VARIABLES = (
    Variable(
        ("PHI4_HOME",),
        "Put every phi4 file under this directory (config, data, state, cache, run).",
    ),
    Variable(("PHI4_RAMDISK",), "Directory to stage the model in (default /dev/shm/phi4-UID)."),
    Variable(
        ("PHI4_BACKEND_KEY",), "API key sent to the --backend server (Authorization: Bearer)."
    ),
    Variable(("PHI4_API_KEY",), "The key phi4 serve --http requires, as --api-key."),
    Variable(
        ("PHI4_HTTP_HEADER_TIMEOUT", "PHI4_HTTP_BODY_TIMEOUT"),
        "Seconds an HTTP client of phi4 serve has to send its headers (10) and its body (30).",
    ),
    Variable(("PHI4_DEBUG",), "Show tracebacks with errors."),
    Variable(("NO_COLOR",), "No colour at a terminal; bold, the live line and the layout stay."),
    Variable(("VISUAL", "EDITOR"), "The editor of phi4 config edit."),
    Variable(("HF_ENDPOINT",), "Hugging Face endpoint used by phi4 pull."),
)
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
    raw = read_config_bytes(path)
    return {} if raw is None else config_from_bytes(raw, path)  # none: no TOML parser to import


def read_config_bytes(path: Path) -> bytes | None:
    """The config file as written (None when there is none), if it may be read at all."""
    from phi4cli.core.atomicfile import RefusedFileError, read_user_file

    try:
        return read_user_file(path, "config file")
    except FileNotFoundError:
        return None
    except RefusedFileError as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None


def config_from_bytes(raw: bytes, path: Path) -> dict[str, Any]:
    """The settings a config file's text holds (``backends`` read as ``backend``); raise
    ConfigError naming ``path`` for what is not TOML or not a known key."""
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
