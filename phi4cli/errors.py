"""The Phi4Error hierarchy and the exit code each error maps to."""

from __future__ import annotations

from enum import IntEnum


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


class DaemonGoneError(DaemonUnavailableError):
    """The connection to the daemon broke: it exited, was killed, or hung up."""


class ProtocolMismatchError(Phi4Error):
    """The daemon still speaks another protocol version after one restart."""

    exit_status = ExitStatus.PROTOCOL_MISMATCH


class EngineError(Phi4Error):
    """llama.cpp failed: the model could not be loaded or decoding broke."""

    exit_status = ExitStatus.ENGINE_FAILURE
