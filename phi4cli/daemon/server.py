"""The daemon process: socket, per-connection dispatch, status file, signals, idle shutdown.

The socket is bound before the model loads, so clients can connect at once and watch progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from phi4cli.core import protocol
from phi4cli.core._settings import Ask
from phi4cli.core.config import FOREVER, Settings
from phi4cli.core.errors import DaemonUnavailableError
from phi4cli.core.paths import Paths, check_socket_path, peer_uid
from phi4cli.core.protocol import ErrorCode, Event, EventKind
from phi4cli.daemon.connections import Connection, Outbox, peer_allowed, silent
from phi4cli.daemon.jobs import Engine
from phi4cli.daemon.operations import LOADING, Operations
from phi4cli.daemon.scheduler import RequestScheduler
from phi4cli.daemon.status import RequestMetrics

log = logging.getLogger("phi4.daemon")

IDLE_CHECK_S = 0.2
# Connections waiting to be accepted (asyncio's default is 100): `phi4 serve` opens one for each
# choice of each request, so eight clients asking n=16 at once make 128 in a moment. (The kernel
# caps it at net.core.somaxconn, 4096 on Linux since 5.4.)
BACKLOG = 4096

# While a client's requests are queued or running, it hears from the daemon at least this often
# (a `progress` event, stage "alive") — as long as the engine is going round: a client that hears
# nothing for much longer may take the daemon for frozen (see client.STREAM_IDLE_TIMEOUT).
HEARTBEAT_S = 20.0
# One engine step longer than this is taken for a hang (heartbeats stop; clients give up 90 s
# later). On lavapipe one step reading 53 prompt tokens of the shaped Phi-4-mini took 173 s.
STEP_ALIVE_S = 900.0
# How long a stop waits for the engine to end what it is in; a load or warm-up cannot be
# interrupted (inside llama.cpp, seconds) and holds nothing to save, so a stop then leaves
# without it after STOP_IN_LOAD_S.
STOP_WAIT_S = 10.0
STOP_IN_LOAD_S = 0.5


class DaemonServer(Operations):
    """The daemon: its socket and connections, its state, its life (start, heartbeats, idle,
    stop). What each op does is in :class:`~phi4cli.daemon.operations.Operations`, what it says of
    itself in :class:`~phi4cli.daemon.status.StatusReport`."""

    def __init__(
        self,
        paths: Paths,
        settings: Settings,
        engine: Engine,
        model_path: Path | None,
    ) -> None:
        self.paths = paths
        self.settings = settings
        self.asked = Ask.of(settings)  # what a request takes where it does not say
        self.keep_alive = settings.keep_alive
        self.engine = engine
        self.model_path = model_path  # loaded, being loaded, or failed to load
        self.state = "starting"
        self.error: str | None = None
        self.started_at = time.time()
        self.requests_served = 0
        self.metrics = RequestMetrics()
        self.last_activity = time.monotonic()
        self._connections: set[Connection] = set()
        self._outbox = Outbox(self._deliver, self._undeliverable)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._stopping = False
        self._stopped_in = ""  # the state a stop came in
        self._uid = os.getuid()
        self._last_beats = -1
        self.scheduler = RequestScheduler(
            engine, model_path, settings.max_queue, self._state_from_worker
        )

    def _state_from_worker(self, state: str, model: Path, error: str | None) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._set_state, state, model, error)

    def _set_state(self, state: str, model: Path, error: str | None) -> None:
        try:
            self._apply_state(state, model, error)
        except Exception:
            log.exception("recording the daemon's state %r failed", state)  # in the event loop

    def _apply_state(self, state: str, model: Path, error: str | None) -> None:
        if self._stopping:
            return
        self.state, self.model_path, self.error = state, model, error
        if state in ("ready", "failed"):
            self.last_activity = time.monotonic()
        log.info("state %s%s", state, f": {error}" if error else "")
        self._write_status()

    # --- connections --------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        connection = Connection(writer)
        if sock is not None and not peer_allowed(sock, self._uid):
            log.warning("refused a connection from uid %s", peer_uid(sock))
            connection.send(
                Event.error(
                    ErrorCode.FORBIDDEN, "this daemon belongs to another user; start your own"
                )
            )
            await self._close(connection)
            return
        self._connections.add(connection)
        framer = protocol.LineFramer()
        try:
            while not connection.closed:
                try:
                    data = await reader.read(65536)
                except ConnectionError:
                    break
                if not data:
                    if framer.pending.strip():
                        self._dispatch_guarded(connection, framer.pending)
                    break
                try:
                    lines = framer.feed(data)
                except protocol.LineTooLong:
                    # The rest of the line is still unread, so the stream cannot be resynchronised:
                    # answer, then hang up on this client only.
                    connection.send(
                        Event.error(
                            ErrorCode.BAD_REQUEST,
                            f"request line longer than {protocol.MAX_LINE_BYTES} bytes",
                        )
                    )
                    break
                for line in lines:
                    if line.strip():
                        self._dispatch_guarded(connection, line)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            # A client that hangs up (Ctrl-C, `| head -1`) stops its generations.
            for job in list(connection.jobs.values()):
                self.scheduler.cancel(job)
            self._connections.discard(connection)
            await self._close(connection)

    async def _close(self, connection: Connection) -> None:
        connection.closed = True
        with contextlib.suppress(ConnectionError, RuntimeError):
            await connection.writer.drain()
        connection.writer.close()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await connection.writer.wait_closed()

    def _dispatch_guarded(self, connection: Connection, line: bytes) -> None:
        """Dispatch a line; whatever fails, even answering the failure, costs this line's answer
        (logged), never the connection's other requests or the event loop."""
        if connection.closed:  # (a line on its way when the client went)
            return
        try:
            self._dispatch(connection, line)
        except Exception:
            log.exception("answering %r failed", line[:200])
            with contextlib.suppress(Exception):
                connection.send(
                    Event.error(ErrorCode.INTERNAL, "internal error in the daemon (see its log)")
                )

    def _undeliverable(self, connection: Connection, request_id: Any, event: Event) -> None:
        log.exception("request %r: cannot deliver a %r event", request_id, event.kind.value)
        job = connection.jobs.pop(request_id, None)
        if job is not None:
            job.emit = silent  # its answer is the error below: nothing more of it goes out
            self.scheduler.cancel(job)
        with contextlib.suppress(Exception):
            connection.hold(
                Event.error(
                    ErrorCode.INTERNAL,
                    "internal error in the daemon: an event of this request "
                    "could not be sent; the request was stopped (see the daemon's log)",
                    request_id,
                )
            )

    def _deliver(self, connection: Connection, request_id: Any, event: Event) -> None:
        connection.hold(event)
        kind = event.kind
        if kind == EventKind.STATS:
            self.metrics.record(event.stats)
        elif kind == EventKind.ERROR:
            self.metrics.errors[event.code.value] += 1
        if kind.terminal:
            job = connection.jobs.pop(request_id, None)
            if kind == EventKind.DONE and job is not None:  # not a command's own end
                self.requests_served += 1
            self.last_activity = time.monotonic()

    # --- lifecycle ----------------------------------------------------------------------------

    def request_shutdown(self, reason: str) -> None:
        if self._stopping:
            return
        log.info("shutting down: %s", reason)
        self._stopping = True
        self._stopped_in, self.state = self.state, "stopping"
        for connection in self._connections:
            for job in connection.jobs.values():
                job.cancel(ErrorCode.SHUTTING_DOWN)
        if self._stopped is not None:
            self._stopped.set()

    def _heartbeat(self) -> None:
        """Tell clients with requests in the daemon that it is alive, if the engine has gone
        round since the last beat, or is in one long call: a model's load, or a step that began
        less than STEP_ALIVE_S ago (a slow device's prompt batch)."""
        beats = self.scheduler.beats
        stepping = self.scheduler.stepping_since
        in_step = stepping is not None and time.monotonic() - stepping < STEP_ALIVE_S
        if beats == self._last_beats and self.state not in LOADING and not in_step:
            return  # a wedged engine: let the clients' deadlines speak
        self._last_beats = beats
        for connection in list(self._connections):
            try:
                for request_id in list(connection.jobs):
                    connection.hold(Event(EventKind.PROGRESS, request_id, data={"stage": "alive"}))
                connection.flush()
            except Exception:
                log.exception("a heartbeat failed; closing that client's connection")
                connection.closed = True

    async def _watch_idle(self) -> None:
        last_beat = time.monotonic()
        while not self._stopping:
            await asyncio.sleep(IDLE_CHECK_S)
            if time.monotonic() - last_beat >= HEARTBEAT_S:
                last_beat = time.monotonic()
                self._heartbeat()
            if self._idle_expired():
                self.request_shutdown(f"idle for {self.keep_alive:g} s (keep_alive)")

    def _idle_expired(self) -> bool:
        """Whether the daemon has been idle for its keep_alive: no request running or queued,
        and no model loading."""
        if self.keep_alive == FOREVER or self.scheduler.busy or self.state in LOADING:
            return False
        return time.monotonic() - self.last_activity >= self.keep_alive

    async def serve(self) -> None:
        """Bind, load, serve until stopped; clean up the socket and status file on the way out."""
        self._loop = self._outbox.loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        sock_path = self.paths.socket
        check_socket_path(sock_path)
        with contextlib.suppress(FileNotFoundError):
            sock_path.unlink()  # we hold the daemon lock, so any socket here is a dead daemon's
        old_umask = os.umask(
            0o177
        )  # the socket is created 0600: no window where others can connect
        try:
            server = await asyncio.start_unix_server(
                self._handle, path=os.fspath(sock_path), backlog=BACKLOG
            )
        finally:
            os.umask(old_umask)
        os.chmod(sock_path, 0o600)
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(
                signum, self.request_shutdown, signal.Signals(signum).name
            )
        self.state = "loading" if self.model_path else "idle"
        self._write_status()
        log.info("listening on %s (pid %d)", sock_path, os.getpid())
        self.scheduler.start()
        idle = asyncio.create_task(self._watch_idle())
        try:
            await self._stopped.wait()
        finally:
            idle.cancel()
            server.close()
            loading = self._stopped_in in LOADING
            worker_done = await self._loop.run_in_executor(
                None, self.scheduler.stop, STOP_IN_LOAD_S if loading else STOP_WAIT_S
            )
            if not worker_done:
                self.scheduler.drain()  # (the worker is inside llama.cpp)
            await asyncio.sleep(0.05)  # let the last terminal events reach their clients
            for connection in list(self._connections):
                await self._close(connection)
            with contextlib.suppress(FileNotFoundError):
                sock_path.unlink()
            with contextlib.suppress(FileNotFoundError):
                self.paths.status_file.unlink()
            if not worker_done:
                # The engine thread is still inside llama.cpp (an uninterruptible load): freeing
                # the model under it would crash, so leave without tearing anything down.
                if loading:
                    log.info(
                        "stopped during the model's %s (llama.cpp cannot be "
                        "interrupted there): exiting without waiting for it",
                        self._stopped_in,
                    )
                else:
                    log.warning("the engine did not stop in time; exiting without unloading")
                logging.shutdown()
                os._exit(0)
            if self.engine.tend():
                # A context still being made in the background (uninterruptible, seconds): the
                # model cannot be freed under it, and a stop need not wait for it.
                log.info("stopped (a context was still being made: exiting without unloading)")
                logging.shutdown()
                os._exit(0)
            self.engine.close()
            log.info("stopped")


def _take_daemon_lock(paths: Paths) -> int:
    """Take the daemon lock for this process's life; raise DaemonUnavailableError if held."""
    paths.ensure_runtime_dir()
    fd = os.open(paths.daemon_lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DaemonUnavailableError(
            "a phi4 daemon is already running for this user; `phi4 status` shows it"
        ) from None
    # Its pid, for a `phi4 stop` that comes before the status file (written once it listens).
    # Only a help: on a full disk the daemon starts without it.
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def run_daemon(paths: Paths, settings: Settings, model_path: Path | None) -> None:
    """Run the daemon in the foreground until it is stopped (``phi4 daemon run``)."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s [%(process)d] %(message)s",
    )
    lock_fd = _take_daemon_lock(paths)
    try:
        from phi4cli.daemon.threads import choose_wait_policy

        log.info("decoding threads wait with %s", choose_wait_policy())  # before llama.cpp loads
        from phi4cli.daemon.llama import LlamaEngine

        engine = LlamaEngine(
            settings, state_dir=paths.cache_dir / "states", swap_dir=paths.cache_dir / "sessions"
        )
        server = DaemonServer(paths, settings, engine, model_path)
        asyncio.run(server.serve())
    finally:
        os.close(lock_fd)
