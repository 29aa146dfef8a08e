"""Every failure phi4 names: the protocol's error codes, the Phi4Error hierarchy, and the one
table from a code to the exception the CLI raises (so its exit status) and the HTTP status
``phi4 serve`` answers with. A leaf: it imports nothing of phi4 but ``records``."""

from __future__ import annotations

from enum import IntEnum, StrEnum

from phi4cli.core.records import Record


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
    """An expected failure: printed as one line on stderr, mapped to an exit code."""

    exit_status: ExitStatus = ExitStatus.ERROR


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


class ErrorKind(Record):
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


def error_for(code: ErrorCode, message: str) -> Phi4Error:
    """The exception (and so the exit status) the CLI reports for a request's error."""
    first, _, rest = message.partition("\n")
    kind = ERRORS[code]
    if rest and kind.exception is EngineError:
        error = kind.exception(first + " (details in the daemon log)")
        error.__notes__ = [rest]
        return error
    return kind.exception(message)


def http_status_for(code: ErrorCode) -> int:
    return ERRORS[code].http_status
