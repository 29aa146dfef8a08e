"""Settings: defaults < ``config.toml`` < environment (``PHI4_*``) < command-line flags.

The result is one frozen :class:`Settings`; every other module reads settings from it and nothing
else reads the config file. phi4's own environment variables are read here too: each setting's
(:func:`env_name`), and the few that are no setting (:data:`VARIABLES`, through
:func:`variable`); a test keeps any other module from reading a ``PHI4_`` variable itself. The
platform's variables (``HOME``, ``XDG_*``, ``TERM``, ``NO_COLOR``, ``EDITOR``) are read where
they are used, and listed in :data:`VARIABLES` for the docs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from phi4cli.durations import FOREVER as FOREVER
from phi4cli.durations import format_duration as format_duration
from phi4cli.durations import parse_duration
from phi4cli.errors import ConfigError
from phi4cli.records import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

DEFAULT_MODEL = "phi4-mini-reasoning"
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
DEFAULT_KEEP_ALIVE = 30 * 60.0


def _positive_int(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(value)
    number = int(str(value))
    if number <= 0:
        raise ValueError(value)
    return number


def _optional_positive_int(value: object) -> int | None:
    if value is None or str(value).strip().lower() in {"", "none", "auto", "0"}:
        return None
    return _positive_int(value)


MIN_N_CTX = 64  # below this no question fits beside a system prompt (and llama.cpp may abort)
MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS


def _context_size(value: object) -> int | None:
    if value is None or str(value).strip().lower() in {"", "auto", "0"}:
        return None
    number = _positive_int(value)
    if number < MIN_N_CTX:
        raise ValueError(value)
    return number


def _threads(value: object) -> int | None:
    """Up to 4 threads per CPU of this machine (and ggml's 512): more only crash llama.cpp."""
    number = _optional_positive_int(value)
    if number is not None and number > min(MAX_THREADS, 4 * (os.cpu_count() or 1)):
        raise ValueError(value)
    return number


def _one_of(*choices: str) -> Callable[[object], str]:
    """A parser for a setting that is one of ``choices`` (any case)."""

    def parse(value: object) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(value)
        return text

    return parse


# The settings whose values are a fixed set (also what shell completion offers).
CHOICES: dict[str, tuple[str, ...]] = {
    "kv_cache_type": ("f16", "q8_0", "q4_0"),
    "kv_layout": ("auto", "shared", "streams"),
    "ramdisk": ("auto", "on", "off"),
    "mlock": ("true", "false"),
}
_kv_cache_type = _one_of(*CHOICES["kv_cache_type"])
_kv_layout = _one_of(*CHOICES["kv_layout"])
_ramdisk_choice = _one_of(*CHOICES["ramdisk"])


def _gpu_layers(value: object) -> str | int:
    if isinstance(value, bool):
        raise ValueError(value)
    text = str(value).strip().lower()
    if text in ("auto", "all"):
        return text
    number = int(text)
    if number < 0:
        raise ValueError(value)
    return number


def _unit_float(value: object) -> float:
    number = float(str(value))
    if not 0.0 <= number <= 1.0:
        raise ValueError(value)
    return number


def _temperature(value: object) -> float:
    number = float(str(value))
    if not 0.0 <= number <= 5.0:
        raise ValueError(value)
    return number


def _optional_seed(value: object) -> int | None:
    if value is None or str(value).strip().lower() in {"", "none", "random"}:
        return None
    number = int(str(value))
    if number < 0:
        raise ValueError(value)
    return number


def _optional_budget(value: object) -> int | None:
    if value is None or str(value).strip().lower() in {"", "none", "off"}:
        return None
    number = int(str(value))
    if number < 0:
        raise ValueError(value)
    return number


def _ramdisk_mode(value: object) -> str:
    if isinstance(value, bool):  # `ramdisk = true` in TOML
        return "on" if value else "off"
    return _ramdisk_choice(value)


def _positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(value)
    return seconds


def _instruction(value: object) -> str | None:
    text = None if value is None else str(value).strip()
    return None if not text or text.lower() == "none" else text


def _backend_urls(value: object) -> str | None:
    """One URL, or several (replicas of one model): a list (TOML, repeated --backend) or text
    with spaces or commas between them. Kept as one space-separated text."""
    items = value if isinstance(value, (list, tuple)) else [value]
    urls: list[str] = []
    for item in items:
        text = _optional_str(item)
        if text is None or text.lower() == "none":
            continue
        for url in text.replace(",", " ").split():
            from urllib.parse import urlsplit

            parts = urlsplit(url)  # raises ValueError for a malformed one ("http://[::1")
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(value)
            if url not in urls:
                urls.append(url)
    return " ".join(urls) or None


def _boolean(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


def _optional_str(value: object) -> str | None:
    text = None if value is None else str(value)
    return text or None


# key -> (parser, description of allowed values)
_FIELDS: dict[str, tuple[Callable[[object], Any], str]] = {
    "model": (lambda v: str(v).strip() or DEFAULT_MODEL, "a model alias or a path to a .gguf"),
    "keep_alive": (
        parse_duration,
        "a duration such as 30m, 1h, 90s, 0 (unload now) or -1 (forever)",
    ),
    "n_ctx": (
        _context_size,
        f"auto (planned from free memory) or a number of tokens, at least {MIN_N_CTX}",
    ),
    "kv_cache_type": (_kv_cache_type, "f16, q8_0 (half the memory) or q4_0 (a quarter)"),
    "kv_layout": (
        _kv_layout,
        "auto (streams for a reasoning model), shared (one cache: short requests pack in) or "
        "streams (one per request: faster at depth)",
    ),
    "gpu_layers": (_gpu_layers, "auto (as many as fit), all, or a number of layers (0: CPU)"),
    "threads": (
        _threads,
        f"auto, or from 1 to {min(MAX_THREADS, 4 * (os.cpu_count() or 1))} "
        "(4 per CPU of this machine)",
    ),
    "temperature": (_temperature, "a number from 0 to 5"),
    "top_p": (_unit_float, "a number from 0 to 1"),
    "max_tokens": (_optional_positive_int, "a positive integer, or none"),
    "seed": (_optional_seed, "a whole number >= 0, or random"),
    "think_budget": (_optional_budget, "a number of tokens (0 skips thinking), or none"),
    "deterministic": (
        _boolean,
        "true (each request alone, from a clean cache: -t 0 and --seed answers repeat) or false",
    ),
    "ramdisk": (_ramdisk_mode, "auto (stage on tmpfs if there is room), on or off"),
    "mlock": (_boolean, "true or false"),
    "overcommit": (_boolean, "true (load an n_ctx whose KV is over the free memory) or false"),
    "max_queue": (_positive_int, "a positive integer (requests)"),
    "parallel": (_positive_int, "a positive integer (requests decoded together)"),
    "backend": (
        _backend_urls,
        "the http(s) URL of an OpenAI-compatible server (several: replicas), or none",
    ),
    "backend_concurrency": (_positive_int, "a positive integer (requests at once per backend)"),
    "backend_timeout": (_positive_duration, "a duration such as 300s or 10m"),
    "backend_deadline": (_positive_duration, "a duration such as 1h or 30m"),
    "system": (_optional_str, "text"),
    "instruction": (_instruction, "text added after each question, or none"),
}


class Settings(Record):
    model: str = DEFAULT_MODEL
    keep_alive: float = DEFAULT_KEEP_ALIVE
    # KV cache cells shared by all requests; None: planned from the model and free memory.
    n_ctx: int | None = None
    kv_cache_type: str = "f16"  # f16 | q8_0 | q4_0
    kv_layout: str = "auto"  # auto | shared | streams: one KV cache for all, or one per request
    gpu_layers: str | int = "auto"  # auto | all | a number of layers
    threads: int | None = None
    temperature: float = 0.8
    top_p: float = 0.95
    max_tokens: int | None = None
    seed: int | None = None
    # After this many reasoning tokens the daemon closes the thinking; None: no budget.
    think_budget: int | None = None
    # Each request decoded alone from a clean KV cache: -t 0 and --seed N answers repeat exactly.
    deterministic: bool = False
    ramdisk: str = "auto"  # stage the model on tmpfs: auto | on | off
    mlock: bool = False  # pin the model's pages in RAM
    # An explicit n_ctx whose KV cache is over the free memory is refused unless this is true.
    overcommit: bool = False
    max_queue: int = 64  # requests waiting in the daemon before it answers busy
    parallel: int = 4  # requests decoded together (slots of the one llama context)
    # OpenAI-compatible servers to use instead of the daemon: one URL, or several (replicas of
    # one model) separated by spaces.
    backend: str | None = None
    # Requests in flight at once on each of them: enough to fill a GPU server's batch.
    backend_concurrency: int = 16
    backend_timeout: float = 300.0  # seconds a remote server may send no event before we give up
    backend_deadline: float = 3600.0  # seconds one remote request may take in all
    # None: the chat template's own default system prompt ("Your name is Phi, ...").
    system: str | None = None
    # Added after each `phi4 solve` question: what Phi-4-mini-reasoning and DeepSeek-R1 were
    # evaluated with, so answers end in \boxed{} more often. None: the question alone.
    instruction: str | None = DEFAULT_INSTRUCTION


# Settings every command that asks for answers (solve, chat, eval) takes as options.
ANSWER_KEYS = ("think_budget", "system", "temperature", "top_p", "seed", "max_tokens",
               "deterministic", "keep_alive", "n_ctx", "threads", "overcommit",
               "backend", "backend_concurrency")  # fmt: skip

# Settings a daemon takes when it starts and keeps for its life.
DAEMON_SETTINGS = ("n_ctx", "kv_cache_type", "kv_layout", "gpu_layers", "parallel", "threads",
                   "max_queue", "mlock", "ramdisk", "overcommit")  # fmt: skip

# PHI4_RAMDISK names the staging directory (as llama.cpp users expect), so the mode is _MODE.
_ENV_NAMES = {"ramdisk": "PHI4_RAMDISK_MODE"}


def env_name(key: str) -> str:
    return _ENV_NAMES.get(key, f"PHI4_{key.upper()}")


# Where the allowed values depend on this machine, the docs say the rule instead.
_DOC_ALLOWED = {"threads": "auto (the physical cores), or from 1 to 4 per CPU of the machine"}


def setting_help() -> list[tuple[str, str, str]]:
    """Return (key, environment variable, allowed values) for every setting, in table order,
    the same on every machine (for generated docs)."""
    return [(key, env_name(key), _DOC_ALLOWED.get(key, allowed))
            for key, (_, allowed) in _FIELDS.items()]  # fmt: skip


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
    """Return ``value`` parsed for setting ``key``; raise ConfigError naming ``source``."""
    parser, allowed = _FIELDS[key]
    try:
        return parser(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: invalid {key} {value!r}: expected {allowed}") from None


def read_config_file(path: Path) -> dict[str, Any]:
    """Return the parsed config file ({} when absent); raise ConfigError naming bad keys."""
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return {}  # no config file: no TOML parser to import either
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    import tomllib

    try:
        with handle:
            data = tomllib.load(handle)
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file (TOML); fix or remove it") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
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
    text = "".join(f"{name} = {_toml_value(data[name])}\n" for name in sorted(data))
    try:
        write_atomic(config_file, text.encode(), mode=0o644)
    except OSError as exc:  # a full disk, say: not a usage error
        from phi4cli.errors import Phi4Error

        raise Phi4Error(f"cannot write {config_file}: {exc.strerror}; nothing changed") from None
    return parsed


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
