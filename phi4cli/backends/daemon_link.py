"""Talking to the daemon: connect, send a request, iterate its events; start the daemon if needed.

Light on purpose (standard library only): this is the path of every ``phi4 solve``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from phi4cli import __version__
from phi4cli.backends import spawn
from phi4cli.backends.dispatch import Announce
from phi4cli.core import protocol
from phi4cli.core.config import DAEMON_SETTINGS, Settings
from phi4cli.core.errors import (
    DaemonFrozenError,
    DaemonGoneError,
    DaemonUnavailableError,
    Phi4Error,
    ProtocolMismatchError,
    RequestError,
)
from phi4cli.core.paths import Paths, check_socket_path, install_id, is_our_daemon, peer_uid
from phi4cli.core.protocol import ErrorCode, Event, EventKind, Op

START_TIMEOUT = 60.0
STOP_SPAWN_WAIT_S = 10.0  # how long `phi4 stop` waits for a client starting a daemon
STOP_TIMEOUT = 15.0
KILL_GRACE = 5.0  # after SIGTERM, before SIGKILL
# The daemon answers a ping, status, stop or cancel at once from its event loop; one that does
# not within this long is frozen (SIGSTOP, or its loop is wedged).
CALL_TIMEOUT = 10.0
# While requests are in it, the daemon sends a heartbeat every 20 s as long as its engine goes
# round (server.HEARTBEAT_S); nothing for this long means it is frozen.
STREAM_IDLE_TIMEOUT = 90.0
CONNECT_ATTEMPTS = 3
BUSY_RETRY_S = 0.25
_ids = itertools.count(1)


class DaemonRestartRequired(Exception):
    """The daemon answered ``unsupported_version``: it must be replaced by one of ours."""


# How long a connection is tried again while the daemon's backlog is full.
BUSY_CONNECT_S = 5.0


class DaemonConnection:
    """One connection to the daemon socket; requests on it are answered by event streams."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        # Our own framing, not a file object: a Ctrl-C in the middle of a read must not lose
        # the part of a line already received.
        self._framer = protocol.LineFramer()
        self._lines: deque[bytes] = deque()
        self.spawned = False  # this connection's daemon was started for it

    @classmethod
    def open(cls, path: Path) -> DaemonConnection:
        """Connect to the socket at ``path``; raise OSError (ENOENT, ECONNREFUSED...) if none.

        Raise DaemonUnavailableError when the process listening there is another user's: the
        peer check works both ways, and a question is not sent to a stranger.
        """
        check_socket_path(path)
        deadline = time.monotonic() + BUSY_CONNECT_S
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(CALL_TIMEOUT)
            try:
                sock.connect(os.fspath(path))
                uid = peer_uid(sock)
                break
            except BlockingIOError:
                # EAGAIN: the daemon's backlog is full (a burst of connections); it takes them
                # within moments.
                sock.close()
                if time.monotonic() >= deadline:
                    raise DaemonUnavailableError(
                        "the daemon has more connections waiting than it can take; try again "
                        "in a moment"
                    ) from None
                time.sleep(0.02)
            except OSError:
                sock.close()
                raise
        if uid is not None and uid != os.getuid():
            sock.close()
            raise DaemonUnavailableError(foreign_socket(os.fspath(path), uid))
        return cls(sock)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> DaemonConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, op: str, params: dict[str, Any] | None = None) -> int:
        """Send one request; return its id. Raise RequestError for one longer than the daemon
        takes (a very long chat transcript, say), before any of it is sent."""
        request_id, line = _request_line(op, params)
        try:
            self._write(line)
        except OSError as exc:  # ConnectionError: the daemon hung up
            raise DaemonGoneError(f"lost the connection to the daemon: {exc}") from None
        return request_id

    def _write(self, line: bytes) -> None:
        self._sock.sendall(line)

    def next_event(self, timeout: float = STREAM_IDLE_TIMEOUT) -> Event:
        """Return the next event; raise DaemonUnavailableError if the daemon went away, and
        DaemonFrozenError if it sent nothing for ``timeout`` seconds."""
        while not self._lines:
            try:
                self._sock.settimeout(timeout)
                chunk = self._sock.recv(65536)
            except TimeoutError:
                raise _frozen(timeout) from None
            except OSError as exc:
                raise DaemonGoneError(f"lost the connection to the daemon: {exc}") from None
            if not chunk:
                raise DaemonGoneError(
                    "the daemon closed the connection unexpectedly; see the daemon log"
                )
            try:
                self._lines.extend(self._framer.feed(chunk))
            except protocol.LineTooLong as exc:
                raise DaemonUnavailableError(f"the daemon sent garbage: {exc}") from None
        line = self._lines.popleft()
        try:
            return Event.from_wire(protocol.decode(line))
        except protocol.ProtocolViolation as exc:
            raise DaemonUnavailableError(f"the daemon sent garbage: {exc.message}") from None

    def request(
        self, op: str, params: dict[str, Any] | None = None, timeout: float = STREAM_IDLE_TIMEOUT
    ) -> Iterator[Event]:
        """Send a request and yield its events up to and including the terminal one.

        Raise DaemonRestartRequired when the daemon speaks another protocol version.
        """
        request_id = self.send(op, params)
        while True:
            event = self.next_event(timeout)
            if event.id not in (request_id, None):
                continue
            if event.kind == EventKind.ERROR and event.code == ErrorCode.UNSUPPORTED_VERSION:
                raise DaemonRestartRequired(event.message)
            yield event
            if event.terminal:
                return

    def call(self, op: str, params: dict[str, Any] | None = None) -> Event:
        """Send a request and return its terminal ``done`` event; raise the matching Phi4Error
        when the daemon answers with an error. Ops answered at once (ping, status, stop, cancel)
        must answer within CALL_TIMEOUT; ``load`` may take as long as a model load."""
        timeout = STREAM_IDLE_TIMEOUT if op == Op.LOAD else CALL_TIMEOUT
        *_, terminal = self.request(op, params, timeout)
        if terminal.kind == EventKind.ERROR:
            raise terminal.exception()
        return terminal


def _frozen(timeout: float) -> DaemonFrozenError:
    return DaemonFrozenError(
        f"the daemon sent nothing for {timeout:g} s: it is not answering (frozen, or stopped "
        "with SIGSTOP?); `phi4 stop` ends it"
    )


def _request_line(op: str, params: dict[str, Any] | None) -> tuple[int, bytes]:
    request_id = next(_ids)
    request = protocol.Request(id=request_id, op=op, params=params or {})
    line = protocol.encode_request(request)
    if len(line) > protocol.MAX_LINE_BYTES:
        raise RequestError(
            f"the request is {len(line):,} bytes; the daemon takes at most "
            f"{protocol.MAX_LINE_BYTES:,} (shorten the question, or /reset a long chat)"
        )
    return request_id, line


def foreign_socket(path: str, uid: int) -> str:
    """What is said of a socket another user's process serves (a runtime dir of ours, with a
    socket planted in it): no question is sent to it."""
    return (
        f"the socket {path} is served by another user's process (uid {uid}); phi4 will not "
        f"talk to it: remove {os.path.dirname(path)}, or set XDG_RUNTIME_DIR"
    )


def try_connect(paths: Paths) -> DaemonConnection | None:
    """Return a connection to a running daemon, or None when nothing listens on the socket.

    Raise DaemonUnavailableError when the socket exists but cannot be used (permissions, ...).
    """
    paths.check_runtime_dir()
    try:
        return DaemonConnection.open(paths.socket)
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    except TimeoutError:
        raise DaemonFrozenError(
            f"the daemon does not accept connections on {paths.socket} (frozen?); "
            "`phi4 stop` ends it"
        ) from None
    except OSError as exc:
        raise DaemonUnavailableError(f"cannot connect to {paths.socket}: {exc.strerror}") from None


def ensure_daemon(
    paths: Paths,
    settings: Settings,
    model_path: Path | None,
    announce: Announce,
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


def stop_daemon(
    paths: Paths, timeout: float = STOP_TIMEOUT, announce: Announce | None = None
) -> int | None:
    """Stop the running daemon and wait for it to exit; return its pid, or None if none ran.

    Asks over the socket first. A daemon that does not answer (frozen, or of another protocol)
    gets SIGTERM, then SIGKILL after a grace; one that answered but does not exit within
    ``timeout`` gets SIGKILL. A pid from the status file is signalled only once /proc shows it is
    a phi4 daemon of this user's (the file may be stale or planted). Raise
    DaemonUnavailableError if it will not exit.
    """
    # A client starting a daemon holds the spawn lock until the daemon answers: that daemon is
    # the one to stop, once it can be asked (else `stop` found none, and it came up after). A
    # client waiting longer (for a daemon wedged before it listens) is not waited for.
    if not paths.runtime_dir.is_dir():  # (no daemon, and none starting: nothing to make)
        return _stop_daemon(paths, timeout, announce)
    with spawn.spawn_lock(paths, timeout=STOP_SPAWN_WAIT_S):
        return _stop_daemon(paths, timeout, announce)


def _stop_daemon(paths: Paths, timeout: float, announce: Announce | None) -> int | None:
    import signal  # here, not at the top: a solve never needs it

    status = spawn.read_status(paths)
    pid = status.pid if status else None
    asked = False
    try:
        connection = try_connect(paths)
    except DaemonFrozenError:
        connection = None
    where = paths.status_file
    if connection is None and pid is None and spawn.daemon_alive(paths):
        # Starting (by hand, or by a service manager) or wedged before it listens: no status
        # file yet, but it wrote its pid into the lock as it took it.
        pid, where = spawn.lock_holder(paths), paths.daemon_lock
    if connection is not None:
        with connection:
            try:
                pid = connection.call(Op.STOP).result.get("pid", pid)
                asked = True
            except (DaemonRestartRequired, Phi4Error):
                pass  # frozen, or not ours to talk to: signal it below
    elif not spawn.daemon_alive(paths):
        spawn.remove_stale_files(paths)
        return None
    if pid is None:
        if spawn.daemon_alive(paths):
            raise DaemonUnavailableError(
                f"a daemon holds {paths.daemon_lock} but does not answer, and its pid is unknown "
                "(no status file); find it with `pgrep -af 'phi4cli daemon run'`"
            )
        return None
    if not asked:
        if not is_our_daemon(pid):
            if not spawn.daemon_alive(paths):
                spawn.remove_stale_files(paths)
                return None
            raise DaemonUnavailableError(
                f"pid {pid} in {where} is not a phi4 daemon of yours, so it is not "
                "signalled; find the daemon with `pgrep -af 'phi4cli daemon run'`"
            )
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    if not wait_until_gone(paths, timeout if asked else KILL_GRACE, pid):
        if not is_our_daemon(pid):
            raise DaemonUnavailableError(f"the daemon (pid {pid}) did not exit")
        if announce is not None:
            announce(f"the daemon (pid {pid}) did not exit; killing it")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if not wait_until_gone(paths, KILL_GRACE, pid):
            raise DaemonUnavailableError(f"the daemon (pid {pid}) survived SIGKILL")
    spawn.remove_stale_files(paths)
    return pid


def clear_daemon_prompts(paths: Paths) -> dict[str, int] | None:
    """Have the running daemon forget the prompts it keeps in RAM; return what it held, or None
    when no daemon runs."""
    connection = try_connect(paths)
    if connection is None:
        return None
    with connection:
        cleared: dict[str, int] = connection.call(Op.CLEAR).result["prompt_cache"]
        return cleared


def daemon_status(paths: Paths) -> dict[str, Any]:
    """Return the running daemon's live status; raise DaemonUnavailableError if none answers."""
    connection = try_connect(paths)
    if connection is None:
        if spawn.daemon_alive(paths):  # it holds the lock, and does not listen (yet, or now)
            pid = spawn.lock_holder(paths)
            who = f" (pid {pid})" if pid else ""
            raise DaemonUnavailableError(
                f"the daemon{who} is starting or stopping and does not answer now; try again "
                "in a moment"
            )
        raise DaemonUnavailableError("no daemon is running; `phi4 daemon start` starts one")
    with connection:
        try:
            return connection.call(Op.STATUS).result
        except DaemonRestartRequired as exc:
            raise DaemonUnavailableError(f"the running daemon is incompatible: {exc}") from None
        except DaemonFrozenError:
            status = spawn.read_status(paths)
            who = f" (pid {status.pid})" if status else ""
            raise DaemonFrozenError(
                f"the daemon{who} is not answering (frozen, or stopped with SIGSTOP?); "
                "`phi4 stop` ends it"
            ) from None


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


def connect_checked(
    paths: Paths,
    settings: Settings,
    model_path: Path | None,
    announce: Announce,
) -> DaemonConnection:
    """Return a connection to a daemon that answers and speaks our protocol version.

    A daemon of another protocol version, or from another install of phi4 (like dmypy, it
    compares the version and where the package lives), is stopped and replaced once
    (ProtocolMismatchError if the replacement still disagrees). One that hangs up at once — it
    was dying as we connected — is waited for and replaced.
    """
    restarted = False
    for attempt in range(CONNECT_ATTEMPTS):
        connection = ensure_daemon(paths, settings, model_path, announce)
        try:
            ping = connection.call(Op.PING).result
            other = _other_install(ping)
        except DaemonRestartRequired:
            other = "speaks another protocol version"
        except DaemonGoneError:
            connection.close()
            if connection.spawned:
                # The daemon this client just started died at once: starting more would not
                # help (a full disk, a broken install); say what its log says.
                detail = spawn.last_log_line(paths)
                raise DaemonUnavailableError(
                    "the daemon exited as it started"
                    + (f": {detail}" if detail else "")
                    + f"; see {paths.log_file}"
                ) from None
            if attempt == CONNECT_ATTEMPTS - 1:
                raise
            wait_until_gone(paths)
            continue
        except BaseException:
            connection.close()
            raise
        if other is None:
            if not connection.spawned:
                _warn_settings(ping.get("settings"), settings, announce)
            return connection
        connection.close()
        if restarted:
            raise ProtocolMismatchError(
                f"the daemon still {other} after a restart; is another phi4 installed "
                "elsewhere? stop it with `phi4 stop`"
            )
        restarted = True
        announce(f"the running daemon {other}; restarting it...")
        stop_daemon(paths, announce=announce)
    raise DaemonUnavailableError("could not reach a working daemon")


def _other_install(ping: dict[str, Any]) -> str | None:
    """Say how the daemon that answered ``ping`` differs from this client; None if it does not.

    A daemon too old to report where it lives is judged by its version alone.
    """
    version, install = ping.get("version"), ping.get("install")
    if version != __version__:
        return f"is phi4 {version} (this is {__version__})"
    if install is not None and install != install_id():
        return f"is from another install of phi4 ({install})"
    return None


def _warn_settings(running: dict[str, Any] | None, settings: Settings, announce: Announce) -> None:
    """Say when the running daemon was started with other settings than these (say, n_ctx in
    the config file changed since). It keeps them: other clients may be mid-answer, and
    restarting it would cut them off; `phi4 stop` applies the new ones. Settings left at their
    defaults here ask for nothing: a daemon started with `--n-ctx 16384` is not questioned by
    every later `phi4 solve`."""
    if not isinstance(running, dict):
        return

    def shown(value: object) -> object:
        return "auto" if value is None else value

    differ = [
        f"{key} {shown(running[key])} (yours {shown(getattr(settings, key))})"
        for key in DAEMON_SETTINGS
        if key in running
        and running[key] != getattr(settings, key)
        and getattr(settings, key) != Settings._field_defaults[key]
    ]
    if differ:
        announce(
            f"the running daemon keeps the settings it started with: {', '.join(differ)}; "
            "`phi4 stop` first to change them"
        )
