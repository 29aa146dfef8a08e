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
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from phi4cli import protocol
from phi4cli.config import Settings
from phi4cli.daemon import spawn
from phi4cli.errors import (
    DaemonGoneError,
    DaemonUnavailableError,
    EngineError,
    Phi4Error,
    ProtocolMismatchError,
    RequestError,
)
from phi4cli.paths import Paths, check_socket_path

START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
CONNECT_ATTEMPTS = 3
BUSY_RETRY_S = 0.25
_ids = itertools.count(1)


class DaemonRestartRequired(Exception):
    """The daemon answered ``unsupported_version``: it must be replaced by one of ours."""


class DaemonConnection:
    """One connection to the daemon socket; requests on it are answered by event streams."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        # Our own buffer, not a file object: a Ctrl-C in the middle of a read must not lose
        # the part of a line already received.
        self._buffer = bytearray()
        self.spawned = False  # this connection's daemon was started for it

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
            raise DaemonGoneError(f"lost the connection to the daemon: {exc}") from None
        return request_id

    def next_event(self) -> dict[str, Any]:
        """Return the next event; raise DaemonUnavailableError if the daemon went away."""
        while (end := self._buffer.find(b"\n")) < 0:
            try:
                chunk = self._sock.recv(65536)
            except OSError as exc:
                raise DaemonGoneError(f"lost the connection to the daemon: {exc}") from None
            if not chunk:
                raise DaemonGoneError(
                    "the daemon closed the connection unexpectedly; see the daemon log"
                )
            self._buffer += chunk
        line = bytes(self._buffer[: end + 1])
        del self._buffer[: end + 1]
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
        """Send a request and return its terminal ``done`` event; raise the matching Phi4Error
        when the daemon answers with an error."""
        *_, terminal = self.request(op, params)
        if terminal.get("event") == "error":
            raise error_for(terminal)
        return terminal


def try_connect(paths: Paths) -> DaemonConnection | None:
    """Return a connection to a running daemon, or None when nothing listens on the socket.

    Raise DaemonUnavailableError when the socket exists but cannot be used (permissions, ...).
    """
    try:
        return DaemonConnection.open(paths.socket)
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    except OSError as exc:
        raise DaemonUnavailableError(f"cannot connect to {paths.socket}: {exc.strerror}") from None


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
        while True:
            connection = try_connect(paths)
            if connection is not None:
                return connection
            if spawn.remove_stale_files(paths):
                announce("removed the socket of a daemon that is no longer running")
            if spawn.daemon_alive(paths):
                # One is starting up (by hand) or shutting down: wait for its socket or its end.
                connection = _wait_for_socket(paths, None)
                if connection is not None:
                    return connection
                continue
            announce("starting the phi4 daemon (first call; later calls reuse it)...")
            process = spawn.spawn_daemon(paths, settings, model_path)
            connection = _wait_for_socket(paths, process)
            if connection is None:  # pragma: no cover - _wait_for_socket raises for a process
                raise DaemonUnavailableError("the daemon did not start")
            connection.spawned = True
            return connection


def _wait_for_socket(paths: Paths, process: Any) -> DaemonConnection | None:
    """Wait for the daemon's socket to accept connections.

    With ``process`` (one we spawned): raise DaemonUnavailableError if it exits or takes too
    long. Without: return None as soon as no daemon holds the lock any more.
    """
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        connection = try_connect(paths)
        if connection is not None:
            return connection
        if process is None and not spawn.daemon_alive(paths):
            return None
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
    asked = False
    if connection is not None:
        with connection:
            try:
                pid = connection.call("stop").get("result", {}).get("pid", pid)
                asked = True
            except (DaemonRestartRequired, Phi4Error):
                pass  # not ours to talk to: signal it below
    elif not spawn.daemon_alive(paths):
        spawn.remove_stale_files(paths)
        return None
    if not asked and pid is not None:
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


def daemon_status(paths: Paths) -> dict[str, Any]:
    """Return the running daemon's live status; raise DaemonUnavailableError if none answers."""
    connection = try_connect(paths)
    if connection is None:
        raise DaemonUnavailableError("no daemon is running; `phi4 daemon start` starts one")
    with connection:
        try:
            reply = connection.call("status")
        except DaemonRestartRequired as exc:
            raise DaemonUnavailableError(f"the running daemon is incompatible: {exc}") from None
    result: dict[str, Any] = reply.get("result", {})
    return result


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


def connect_checked(
    paths: Paths, settings: Settings, model_path: Path | None, announce: Callable[[str], None]
) -> DaemonConnection:
    """Return a connection to a daemon that answers and speaks our protocol version.

    A daemon of another version is stopped and replaced once (ProtocolMismatchError if the
    replacement still disagrees). One that hangs up at once — it was dying as we connected — is
    waited for and replaced.
    """
    restarted = False
    for attempt in range(CONNECT_ATTEMPTS):
        connection = ensure_daemon(paths, settings, model_path, announce)
        try:
            connection.call("ping")
            return connection
        except DaemonRestartRequired:
            connection.close()
            if restarted:
                raise ProtocolMismatchError(
                    "the daemon still speaks another protocol version after a restart; "
                    "is an older phi4 installed elsewhere? stop it with `phi4 stop`"
                ) from None
            restarted = True
            announce("the running daemon speaks another protocol version; restarting it...")
            stop_daemon(paths)
        except DaemonGoneError:
            connection.close()
            if attempt == CONNECT_ATTEMPTS - 1:
                raise
            wait_until_gone(paths)
        except BaseException:
            connection.close()
            raise
    raise DaemonUnavailableError("could not reach a working daemon")


EventSink = Callable[[int, dict[str, Any]], None]


def solve_many(
    paths: Paths,
    settings: Settings,
    model_path: Path | None,
    requests: list[dict[str, Any]],
    on_event: EventSink,
    announce: Callable[[str], None],
    window: int = 16,
) -> None:
    """Send solve requests over one connection, at most ``window`` in flight, and pass every
    event to ``on_event(index, event)``; each request ends with exactly one terminal event.

    Requests the daemon found busy are sent again once others finish. Requests that met a daemon
    shutting down before producing anything are sent again, once, to a fresh daemon. Interrupting
    this (Ctrl-C) closes the connection, which cancels every request still running.
    """
    batch = _Batch(requests, on_event, window)
    retried = False
    while batch.waiting:
        connection = connect_checked(paths, settings, model_path, announce)
        with connection:
            batch.run(connection)
        if not batch.waiting:
            return
        if retried:
            raise DaemonUnavailableError("the daemon stopped twice while answering; see its log")
        retried = True
        announce("the daemon was shutting down; starting a fresh one...")
        wait_until_gone(paths)


class _Batch:
    """The bookkeeping of ``solve_many``: what waits, what is in flight, what has produced."""

    def __init__(self, requests: list[dict[str, Any]], on_event: EventSink, window: int) -> None:
        self.requests = requests
        self.on_event = on_event
        self.window = window
        self.waiting: deque[int] = deque(range(len(requests)))
        self.produced: set[int] = set()
        self.shutdown_seen = False

    def run(self, connection: DaemonConnection) -> None:
        """Drive requests over ``connection`` until all are answered, or the daemon goes away;
        requests still worth sending again are left in ``waiting``."""
        in_flight: dict[Any, int] = {}
        resend: list[int] = []
        try:
            while self.waiting or in_flight:
                while self.waiting and len(in_flight) < self.window and not self.shutdown_seen:
                    index = self.waiting.popleft()
                    in_flight[connection.send("solve", self.requests[index])] = index
                if not in_flight:
                    break
                self._handle(connection.next_event(), in_flight, resend)
        except DaemonGoneError:
            if not resend and not self.shutdown_seen:
                raise
            for request_id, index in in_flight.items():
                if index in self.produced:  # cut off mid-answer: say so, do not answer twice
                    self.on_event(index, protocol.error_event(
                        request_id, protocol.SHUTTING_DOWN, "the daemon stopped mid-answer"
                    ))  # fmt: skip
                else:
                    resend.append(index)
        self.waiting = deque(sorted([*resend, *self.waiting]))

    def _handle(self, event: dict[str, Any], in_flight: dict[Any, int], resend: list[int]) -> None:
        index = in_flight.get(event.get("id"))
        if index is None:
            return
        kind, code = event.get("event"), event.get("code")
        if kind == "error" and code == protocol.BUSY:
            # The queue is full (other clients too): keep fewer in flight, send this one later.
            del in_flight[event["id"]]
            self.window = max(1, len(in_flight))
            self.waiting.appendleft(index)
            if not in_flight:
                time.sleep(BUSY_RETRY_S)  # nothing of ours to wait for: back off a little
            return
        if kind == "error" and code == protocol.SHUTTING_DOWN and index not in self.produced:
            del in_flight[event["id"]]
            self.shutdown_seen = True
            resend.append(index)
            return
        if kind in ("token", "reasoning"):
            self.produced.add(index)
        self.on_event(index, event)
        if kind in protocol.TERMINAL_EVENTS:
            del in_flight[event["id"]]
