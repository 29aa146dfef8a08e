"""Every failure phi4 names: the protocol's error codes, the Phi4Error hierarchy, and the one
table from a code to the exception the CLI raises (so its exit status) and the HTTP status
``phi4 serve`` answers with. A leaf: it imports nothing of phi4 but ``records``."""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Callable


class ErrorCode(StrEnum):
    BAD_REQUEST = "bad_request"
    UNSUPPORTED_VERSION = "unsupported_version"
    BUSY = "busy"
    CONTEXT_OVERFLOW = "context_overflow"
    MODEL_ERROR = "model_error"
    CANCELLED = "cancelled"
    SHUTTING_DOWN = "shutting_down"
    FORBIDDEN = "forbidden"
    INTERNAL = "internal"
    # A remote engine's failures: no answer in time, or a stream that broke or made no sense.
    TIMEOUT = "timeout"
    BACKEND_ERROR = "backend_error"
    UNREACHABLE = "unreachable"  # no replica could be reached (or every one went away)

    @property
    def retryable(self) -> bool:
        return self in (ErrorCode.BUSY, ErrorCode.SHUTTING_DOWN)

    @classmethod
    def of(cls, value: object) -> ErrorCode:
        """The code named by ``value``; an unknown one (a newer daemon's) counts as internal."""
        try:
            return cls(str(value))
        except ValueError:
            return cls.INTERNAL


class ExitStatus(IntEnum):
    """One meaning per process exit code (documented in the README and the man page)."""

    OK = 0
    ERROR = 1  # bad input, model missing, context overflow: reported by phi4 itself
    USAGE = 2
    DAEMON_UNAVAILABLE = 3
    PROTOCOL_MISMATCH = 4
    ENGINE_FAILURE = 5
    INTERRUPTED = 130


class Phi4Error(Exception):
    """An expected failure: printed as one line on stderr, mapped to an exit code. A request's
    error keeps its ``fault`` (the facts the daemon sent), where it has one."""

    exit_status: ExitStatus = ExitStatus.ERROR
    fault: Fault | None = None


class UsageError(Phi4Error):
    exit_status = ExitStatus.USAGE


class ConfigError(Phi4Error):
    """The config file or an environment variable holds a value phi4 cannot use."""

    exit_status = ExitStatus.USAGE


class ModelNotFoundError(Phi4Error):
    """The requested model is not on disk (or the alias is unknown)."""


class InvalidModelError(Phi4Error):
    """The model file exists but is not a usable GGUF."""


class DownloadError(Phi4Error):
    """`phi4 pull` could not fetch or verify a model."""


class RequestError(Phi4Error):
    """The daemon rejected a request (bad input, context overflow, busy)."""


class DaemonUnavailableError(Phi4Error):
    """No daemon could be reached or started."""

    exit_status = ExitStatus.DAEMON_UNAVAILABLE


class DaemonFrozenError(DaemonUnavailableError):
    """The daemon holds its socket but does not answer (stopped with SIGSTOP, or wedged)."""


class DaemonGoneError(DaemonUnavailableError):
    """The connection to the daemon broke: it exited, was killed, or hung up."""


class ProtocolMismatchError(Phi4Error):
    """The daemon still speaks another protocol version after one restart."""

    exit_status = ExitStatus.PROTOCOL_MISMATCH


class EngineError(Phi4Error):
    """llama.cpp failed: the model could not be loaded or decoding broke."""

    exit_status = ExitStatus.ENGINE_FAILURE


class BackendError(Phi4Error):
    """A remote engine broke off or sent what phi4 cannot read."""

    exit_status = ExitStatus.ENGINE_FAILURE


class CancelledError(Phi4Error):
    """The request was cancelled (Ctrl-C, or another client cancelled it)."""

    exit_status = ExitStatus.INTERRUPTED


class ErrorKind(NamedTuple):
    """What one protocol error code means on each side: the exception the CLI raises (and so
    its exit status) and the HTTP status ``phi4 serve`` answers with."""

    exception: type[Phi4Error]
    http_status: int


# The one table from error code to exception, exit status and HTTP status.
ERRORS: dict[ErrorCode, ErrorKind] = {
    ErrorCode.BAD_REQUEST: ErrorKind(RequestError, 400),
    ErrorCode.CONTEXT_OVERFLOW: ErrorKind(RequestError, 400),
    ErrorCode.UNSUPPORTED_VERSION: ErrorKind(ProtocolMismatchError, 400),
    ErrorCode.BUSY: ErrorKind(RequestError, 429),
    ErrorCode.FORBIDDEN: ErrorKind(DaemonUnavailableError, 403),
    ErrorCode.SHUTTING_DOWN: ErrorKind(DaemonUnavailableError, 503),
    ErrorCode.CANCELLED: ErrorKind(CancelledError, 499),
    ErrorCode.TIMEOUT: ErrorKind(BackendError, 504),
    ErrorCode.BACKEND_ERROR: ErrorKind(BackendError, 502),
    ErrorCode.UNREACHABLE: ErrorKind(DaemonUnavailableError, 502),
    ErrorCode.MODEL_ERROR: ErrorKind(EngineError, 500),
    ErrorCode.INTERNAL: ErrorKind(EngineError, 500),
}


class Fault(NamedTuple):
    """An error's facts, as data: the request field at fault and the numbers. The daemon sends
    them beside its message (the error event's ``fault``); each door words them its own way:
    the CLI names its flags and what to run, ``phi4 serve`` OpenAI's fields (and ``param``), the
    daemon log both. No door reads another's prose.

    Context faults count tokens: the request ``needed`` so many, and one request may hold
    ``limit`` (a stream's cells with ``streams``, else the context less the system prompt's
    ``system`` cells), or ``available`` were free with nothing running.

    A memory plan the daemon refused to load (``param`` ``n_ctx`` or ``gpu_layers``, the daemon's
    settings) says what was asked (``needed``: tokens of context, or layers) and what fits
    (``limit``; 0: no layer), and its ``facts`` in words that name no door's flags (the bytes
    needed and free)."""

    param: str  # "max_tokens" (lower it) or "prompt" (too long on its own): the wire's names
    needed: int = 0
    limit: int = 0
    available: int | None = None
    prompt: int = 0  # of ``needed``, the prompt's tokens (the rest: max_tokens)
    n_ctx: int = 0
    streams: int = 0  # the context split into this many streams (0: one shared cache)
    system: int = 0
    # The daemon could not make its whole context and answers from a smaller one (``n_ctx``),
    # which cannot hold this request (its log says why).
    shrunk: bool = False
    facts: str = ""
    model: str = ""  # the model file's name (a plan fault's)

    def to_wire(self) -> dict[str, object]:
        return {key: value for key, value in self._asdict().items() if value not in (None, "")}

    @classmethod
    def from_wire(cls, data: object) -> Fault | None:
        """The fault an error event carries, or None (an older daemon's, or a malformed one)."""
        if not isinstance(data, dict) or not isinstance(data.get("param"), str):
            return None
        known = {k: v for k, v in data.items() if k in cls._fields}
        numbers = [v for k, v in known.items() if k not in _WORDS and v is not None]
        if any(not isinstance(v, int) for v in numbers):  # (bool, for shrunk, is an int)
            return None
        if any(not isinstance(known.get(key, ""), str) for key in _WORDS):
            return None
        return cls(**known)


_WORDS = ("param", "facts", "model")  # a Fault's fields that are words, not numbers
PLAN_PARAMS = ("n_ctx", "gpu_layers")  # the daemon's settings a memory plan can refuse


def _plan_words(fault: Fault, flag: Callable[[str, str], str]) -> str:
    """A refused memory plan: its facts and what to change, each setting as ``flag(name,
    value)`` says it (``--n-ctx 4,096`` on the command line)."""
    anyway = f"or load it anyway with {flag('overcommit', '')}"
    if fault.param == "n_ctx":
        return (
            f"{fault.facts}; {flag('n_ctx', str(fault.limit))} fits, "
            f"{flag('kv_cache_type', 'q8_0')} halves the memory, {anyway}"
        )
    advice = (
        f"{flag('gpu_layers', str(fault.limit))} fits (what auto chooses)"
        if fault.limit
        else f"no layer fits beside this context: use {flag('gpu_layers', '0')}"
    )
    return f"{fault.facts}; {advice}, a smaller {flag('n_ctx', '')}, {anyway}"


def _cli_flag(name: str, value: str) -> str:
    return " ".join(part for part in ("--" + name.replace("_", "-"), value) if part)


def _setting(name: str, value: str) -> str:
    return f"{name} = {value}" if value else name


def _both(name: str, value: str) -> str:
    return f"{_setting(name, value)} ({_cli_flag(name, value)})"


RESTART = "phi4 stop; phi4 daemon start --n-ctx N"


def cli_words(fault: Fault, max_tokens: str = "--max-tokens") -> str:
    """A context fault as the command line says it: its flags (``max_tokens`` names the one
    for the answer's tokens: a chat says ``max_tokens``, set with /set), and what to run."""
    if fault.param in PLAN_PARAMS:
        return (
            f"cannot plan memory for {fault.model or 'the model'}: {_plan_words(fault, _cli_flag)}"
        )
    lower = f"lower {max_tokens}, or restart the daemon with a larger one ({RESTART})"
    if fault.shrunk:
        return (
            f"the daemon could not make its whole context (its log says why) and the "
            f"{fault.n_ctx:,}-token one it answers from cannot hold this request; lower "
            f"{max_tokens}, or restart the daemon (phi4 stop)"
        )
    if fault.available is not None:
        return (
            f"the request needs {fault.needed:,} tokens of context and only "
            f"{fault.available:,} are free with nothing running; {lower}"
        )
    if fault.streams:
        holds = (
            f"a request's stream of the daemon's context holds {fault.limit:,} (--n-ctx "
            f"{fault.n_ctx:,} over {fault.streams} streams)"
        )
    elif fault.system:
        holds = (
            f"the daemon's context holds {fault.n_ctx:,} ({fault.system:,} of them the "
            "system prompt's)"
        )
    else:
        holds = f"the daemon's context holds {fault.limit:,} for one request"
    if fault.param == "max_tokens":
        return (
            f"this request needs {fault.needed:,} tokens of context ({fault.prompt:,} of "
            f"prompt + {fault.needed - fault.prompt:,} of {max_tokens}) but {holds}; "
            f"{lower}"
        )
    return (
        f"the question is {fault.prompt:,} tokens but {holds}; shorten it, or restart the "
        f"daemon with a larger context ({RESTART})"
    )


def api_words(fault: Fault) -> tuple[str, str | None]:
    """A fault as an OpenAI-shaped API says it: the message, and the ``param`` (the request
    field at fault; none for the server's own settings)."""
    if fault.param in PLAN_PARAMS:
        return f"the server cannot load its model: {_plan_words(fault, _setting)}", None
    if fault.shrunk:
        return (
            f"the server could not make its whole context and the {fault.n_ctx:,}-token one it "
            "answers from cannot hold this request; lower max_tokens",
            "max_tokens",
        )
    if fault.available is not None:
        return (
            f"the request needs {fault.needed:,} tokens of context and only "
            f"{fault.available:,} are free; lower max_tokens",
            "max_tokens",
        )
    if fault.param == "max_tokens":
        return (
            f"this request needs {fault.needed:,} tokens of context ({fault.prompt:,} of "
            f"messages + {fault.needed - fault.prompt:,} of max_tokens) but the model's "
            f"context holds {fault.limit:,} for one request; lower max_tokens",
            "max_tokens",
        )
    return (
        f"the messages are {fault.prompt:,} tokens but the model's context holds "
        f"{fault.limit:,} for one request; shorten them",
        "messages",
    )


def log_words(fault: Fault) -> str:
    """A context fault as the daemon's log (and its error event's message, for a client that
    does not read the fault) says it: both doors' names."""
    if fault.param in PLAN_PARAMS:
        return _plan_words(fault, _both)  # (the log's line names the model file before it)
    return cli_words(fault, max_tokens="max_tokens (--max-tokens)")


def error_for(code: ErrorCode, message: str, fault: Fault | None = None) -> Phi4Error:
    """The exception (and so the exit status) the CLI reports for a request's error: worded
    from its ``fault`` where it has one."""
    if fault is not None:
        message = cli_words(fault)
    first, _, rest = message.partition("\n")
    kind = ERRORS[code]
    if rest and kind.exception is EngineError:
        error = kind.exception(first + " (details in the daemon log)")
        error.__notes__ = [rest]
        return error
    refused = kind.exception(message)
    refused.fault = fault  # (for a door that words it its own way: a chat)
    return refused


def http_status_for(code: ErrorCode) -> int:
    return ERRORS[code].http_status
