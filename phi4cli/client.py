"""Talking to the daemon: connect, send a request, iterate its events; start the daemon if needed.

Light on purpose (standard library only): this is the path of every ``phi4 solve``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

from phi4cli import protocol
from phi4cli.config import Settings
from phi4cli.daemon import spawn
from phi4cli.errors import (
    DaemonUnavailableError,
    EngineError,
    Phi4Error,
    ProtocolMismatchError,
    RequestError,
)
from phi4cli.paths import Paths, check_socket_path

START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
_ids = itertools.count(1)


class DaemonRestartRequired(Exception):
    """The daemon answered ``unsupported_version``: it must be replaced by one of ours."""


class DaemonConnection:
    """One connection to the daemon socket; requests on it are answered by event streams."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reader = sock.makefile("rb")

    @classmethod
    def open(cls, path: Path) -> DaemonConnection:
        """Connect to the socket at ``path``; raise OSError (ENOENT, ECONNREFUSED...) if none."""
        check_socket_path(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(os.fspath(path))
        except OSError:
            sock.close()
            raise
        return cls(sock)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._reader.close()
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> DaemonConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, op: str, params: dict[str, Any] | None = None) -> int:
        """Send one request; return its id."""
        request_id = next(_ids)
        request = protocol.Request(id=request_id, op=op, params=params or {})
        try:
            self._sock.sendall(protocol.encode_request(request))
        except OSError as exc:
            raise DaemonUnavailableError(f"lost the connection to the daemon: {exc}") from None
        return request_id

    def next_event(self) -> dict[str, Any]:
        """Return the next event; raise DaemonUnavailableError if the daemon went away."""
        try:
            line = self._reader.readline()
        except OSError as exc:
            raise DaemonUnavailableError(f"lost the connection to the daemon: {exc}") from None
        if not line:
            raise DaemonUnavailableError(
                "the daemon closed the connection unexpectedly; see `phi4 logs` or the daemon log"
            )
        try:
            return protocol.decode(line)
        except protocol.ProtocolViolation as exc:
            raise DaemonUnavailableError(f"the daemon sent garbage: {exc.message}") from None

    def request(self, op: str, params: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        """Send a request and yield its events up to and including the terminal one.

        Raise DaemonRestartRequired when the daemon speaks another protocol version.
        """
        request_id = self.send(op, params)
        while True:
            event = self.next_event()
            if event.get("id") not in (request_id, None):
                continue
            if event.get("event") == "error" and event.get("code") == protocol.UNSUPPORTED_VERSION:
                raise DaemonRestartRequired(event.get("message", ""))
            yield event
            if event.get("event") in protocol.TERMINAL_EVENTS:
                return

    def call(self, op: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send a request and return its terminal event."""
        *_, terminal = self.request(op, params)
        return terminal


def try_connect(paths: Paths) -> DaemonConnection | None:
    """Return a connection to a running daemon, or None when nothing listens on the socket."""
    try:
        return DaemonConnection.open(paths.socket)
    except (FileNotFoundError, ConnectionRefusedError):
        return None


def ensure_daemon(
    paths: Paths,
    settings: Settings,
    model_path: Path | None,
    announce: Callable[[str], None],
) -> DaemonConnection:
    """Return a connection to the daemon, starting one (and cleaning a dead one's files) if needed.

    Two clients racing here start one daemon: the spawn lock serialises the decision. Raise
    DaemonUnavailableError when the daemon cannot be started.
    """
    connection = try_connect(paths)
    if connection is not None:
        return connection
    with spawn.spawn_lock(paths):
        connection = try_connect(paths)
        if connection is not None:
            return connection
        if spawn.remove_stale_files(paths):
            announce("removed the socket of a daemon that is no longer running")
        if not spawn.daemon_alive(paths):
            announce("starting the phi4 daemon (first call; later calls reuse it)...")
            process = spawn.spawn_daemon(paths, settings, model_path)
        else:
            process = None  # another daemon is starting up by hand: wait for its socket
        return _wait_for_socket(paths, process)


def _wait_for_socket(paths: Paths, process: Any) -> DaemonConnection:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        connection = try_connect(paths)
        if connection is not None:
            return connection
        if process is not None and process.poll() is not None:
            detail = spawn.last_log_line(paths)
            raise DaemonUnavailableError(
                f"the daemon exited during start-up (code {process.returncode})"
                + (f": {detail}" if detail else "")
                + f"; see {paths.log_file}"
            )
        time.sleep(0.02)
    raise DaemonUnavailableError(
        f"the daemon did not open {paths.socket} within {START_TIMEOUT:.0f} s; see {paths.log_file}"
    )


def stop_daemon(paths: Paths, timeout: float = STOP_TIMEOUT) -> int | None:
    """Stop the running daemon and wait for it to exit; return its pid, or None if none ran.

    Asks over the socket first; a daemon that does not answer (or speaks another protocol) gets
    SIGTERM by the pid in its status file. Raise DaemonUnavailableError if it will not exit.
    """
    status = spawn.read_status(paths)
    pid = status.pid if status else None
    connection = try_connect(paths)
    if connection is not None:
        with connection:
            try:
                reply = connection.call("stop")
                pid = reply.get("result", {}).get("pid", pid)
            except (DaemonRestartRequired, DaemonUnavailableError):
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
    elif not spawn.daemon_alive(paths):
        spawn.remove_stale_files(paths)
        return None
    elif pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    if pid is None:
        return None
    if not wait_until_gone(paths, timeout, pid):
        raise DaemonUnavailableError(
            f"the daemon (pid {pid}) did not exit within {timeout:.0f} s; kill it with `kill {pid}`"
        )
    spawn.remove_stale_files(paths)
    return pid


def wait_until_gone(paths: Paths, timeout: float = STOP_TIMEOUT, pid: int | None = None) -> bool:
    """Wait until the daemon has released its lock (and process ``pid`` has exited, if given).

    Return False on timeout.
    """
    deadline = time.monotonic() + timeout
    while spawn.daemon_alive(paths) or (pid is not None and spawn.process_running(pid)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def error_for(event: dict[str, Any]) -> Phi4Error:
    """Map a terminal ``error`` event to the exception (and so the exit code) the CLI reports."""
    code = event.get("code", protocol.INTERNAL)
    message = str(event.get("message") or code)
    if code in (protocol.MODEL_ERROR, protocol.INTERNAL):
        first, _, rest = message.partition("\n")
        error: Phi4Error = EngineError(first + (" (details in the daemon log)" if rest else ""))
        error.__notes__ = [rest] if rest else []
        return error
    if code in (protocol.SHUTTING_DOWN, protocol.FORBIDDEN):
        return DaemonUnavailableError(message)
    return RequestError(message)


def stream_solve(
    paths: Paths,
    settings: Settings,
    model_path: Path | None,
    params: dict[str, Any],
    announce: Callable[[str], None],
) -> Generator[dict[str, Any], None, None]:
    """Yield the events of one solve request, up to and including the terminal one.

    Starts the daemon when needed; restarts it once if it speaks another protocol version (then
    raise ProtocolMismatchError); retries once when it was shutting down as the request arrived.
    Closing this generator early closes the connection, which cancels the generation.
    """
    restarted = False
    retried = False
    while True:
        connection = ensure_daemon(paths, settings, model_path, announce)
        try:
            with connection:
                produced = False
                for event in connection.request("solve", params):
                    if (
                        event.get("event") == "error"
                        and event.get("code") == protocol.SHUTTING_DOWN
                        and not produced
                        and not retried
                    ):
                        break
                    produced = produced or event.get("event") == "token"
                    yield event
                else:
                    return
        except DaemonRestartRequired:
            if restarted:
                raise ProtocolMismatchError(
                    "the daemon still speaks another protocol version after a restart; "
                    "is an older phi4 installed elsewhere? stop it with `phi4 stop`"
                ) from None
            restarted = True
            announce("the running daemon speaks another protocol version; restarting it...")
            stop_daemon(paths)
            continue
        retried = True
        announce("the daemon was shutting down; starting a fresh one...")
        wait_until_gone(paths)
