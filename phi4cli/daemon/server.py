"""The daemon process: socket, per-connection dispatch, status file, signals, idle shutdown.

The socket is bound before the model loads, so clients can connect at once and watch progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phi4cli import __version__
from phi4cli.core import protocol
from phi4cli.core._settings import Ask
from phi4cli.core.atomicfile import RefusedFileError, write_atomic
from phi4cli.core.config import DAEMON_SETTINGS, FOREVER, Settings
from phi4cli.core.errors import DaemonUnavailableError
from phi4cli.core.paths import Paths, check_socket_path, peer_uid
from phi4cli.core.protocol import ErrorCode, Event, EventKind, Op, ProtocolViolation, Request, Stats
from phi4cli.daemon.jobs import Engine, Job
from phi4cli.daemon.scheduler import QueueFullError, RequestScheduler

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
_LOADING = ("loading", "warming")
# How long a stop waits for the engine to end what it is in; a load or warm-up cannot be
# interrupted (inside llama.cpp, seconds) and holds nothing to save, so a stop then leaves
# without it after STOP_IN_LOAD_S.
STOP_WAIT_S = 10.0
STOP_IN_LOAD_S = 0.5


def peer_allowed(sock: socket.socket, own_uid: int) -> bool:
    """Return True when the peer runs as ``own_uid``; the socket's 0600 mode is the first guard."""
    uid = peer_uid(sock)
    return uid is None or uid == own_uid


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class RequestMetrics:
    """Counters for `/metrics`: tokens, cache use, request latency, errors by code."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    latency_sum: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    errors: Counter[str] = field(default_factory=Counter)

    def record(self, stats: Stats) -> None:
        self.requests += 1
        self.prompt_tokens += stats.prompt_tokens
        self.cached_tokens += stats.cached_tokens
        self.completion_tokens += stats.completion_tokens
        latency = stats.total_s or 0.0
        self.latency_sum += latency
        for index, bound in enumerate(LATENCY_BUCKETS):
            if latency <= bound:
                self.latency_buckets[index] += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "latency_sum_s": round(self.latency_sum, 6),
            "latency_buckets": dict(
                zip(map(str, LATENCY_BUCKETS), self.latency_buckets, strict=True)
            ),
            "errors": dict(self.errors),
        }


@dataclass(eq=False)
class Connection:
    writer: asyncio.StreamWriter
    jobs: dict[Any, Job] = field(default_factory=dict)
    closed: bool = False
    held: list[bytes] = field(default_factory=list)  # lines to write in one go (see flush)

    def send(self, event: Event) -> None:
        self.hold(event)
        self.flush()

    def hold(self, event: Event) -> None:
        if not self.closed:
            self.held.append(protocol.encode(event.to_wire()))

    def flush(self) -> None:
        if self.closed or not self.held:
            return
        data, self.held = b"".join(self.held), []
        try:
            self.writer.write(data)
        except (ConnectionError, RuntimeError):
            self.closed = True


class _Outbox:
    """Events the engine thread posts for the event loop. Those posted before the loop gets to
    them go out together: one wake-up and one write per connection per decode step, not one per
    token, which on a small machine takes cores from llama.cpp's threads."""

    def __init__(
        self,
        deliver: Callable[[Connection, Any, Event], None],
        undeliverable: Callable[[Connection, Any, Event], None],
    ) -> None:
        self.deliver, self.undeliverable = deliver, undeliverable
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once it serves
        self._posted: list[tuple[Connection, Any, Event]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, connection: Connection, request_id: Any, event: Event) -> None:
        """Hand an event from the engine thread to the event loop."""
        with self._lock:
            self._posted.append((connection, request_id, event))
            if self._scheduled:
                return
            self._scheduled = True
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.flush)

    def flush(self) -> None:
        """Deliver what the engine posted. Runs in the event loop, so nothing may escape: an event
        that cannot be delivered costs its request (``undeliverable``: an error event, the job
        cancelled), logged once, and everyone else's events still go out."""
        with self._lock:
            posted, self._posted = self._posted, []
            self._scheduled = False
        failed: set[tuple[int, Any]] = set()
        for connection, request_id, event in posted:
            key = (id(connection), _hashable(request_id))
            if key in failed:
                continue
            try:
                self.deliver(connection, request_id, event)
            except Exception:
                failed.add(key)
                self.undeliverable(connection, request_id, event)
        for connection in {connection for connection, _, _ in posted}:
            try:
                connection.flush()
            except Exception:
                log.exception("writing to a client failed; closing its connection")
                connection.closed = True


class DaemonServer:
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
        self._outbox = _Outbox(self._deliver, self._undeliverable)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._stopping = False
        self._stopped_in = ""  # the state a stop came in
        self._uid = os.getuid()
        self._last_beats = -1
        self.scheduler = RequestScheduler(
            engine, model_path, settings.max_queue, self._state_from_worker
        )

    # --- status -------------------------------------------------------------------------------

    def status_record(self) -> dict[str, Any]:
        """The status file's content: enough for a client to find and judge this daemon."""
        return {
            "pid": os.getpid(),
            "socket": str(self.paths.socket),
            "protocol": protocol.PROTOCOL_VERSION,
            "version": __version__,
            "state": self.state,
            "model": str(self.model_path) if self.model_path else None,
            "started_at": self.started_at,
            "log": str(self.paths.log_file),
            "error": self.error,
        }

    def live_status(self) -> dict[str, Any]:
        idle_s = None if self.scheduler.busy else time.monotonic() - self.last_activity
        left = None
        if idle_s is not None and self.keep_alive != FOREVER:
            left = max(0.0, self.keep_alive - idle_s)
        return {
            **self.status_record(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "rss_bytes": _rss_bytes(),
            "requests_served": self.requests_served,
            "requests_active": sum(len(c.jobs) for c in self._connections),
            "queued": self.scheduler.queued,
            "idle_s": None if idle_s is None else round(idle_s, 3),
            "keep_alive_s": self.keep_alive,
            "keep_alive_left_s": None if left is None else round(left, 3),
            "n_ctx": self.scheduler.memory.get("n_ctx", self.settings.n_ctx),
            "memory": self.scheduler.memory,
            "waiting": self.scheduler.waiting_for_room(),
            "load": self.scheduler.last_load,
            "metrics": self.metrics.snapshot(),
        }

    def _write_status(self) -> None:
        if self._stopping and self.state != "stopping":
            return
        try:
            write_atomic(self.paths.status_file, json.dumps(self.status_record()).encode())
        except OSError as exc:
            # A full disk must not take the daemon down: clients find it by its socket.
            log.warning("cannot write %s: %s", self.paths.status_file, exc.strerror)
        except RefusedFileError as exc:  # a directory above PHI4_HOME that others can change
            log.warning("%s", exc)

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

    def _dispatch(self, connection: Connection, line: bytes) -> None:
        request: Request | None = None
        try:
            request = protocol.parse_request(line)
            handler = {
                Op.SOLVE: self._op_solve,
                Op.CHAT: self._op_solve,
                Op.LOAD: self._op_solve,
                Op.STATUS: self._op_status,
                Op.STOP: self._op_stop,
                Op.CANCEL: self._op_cancel,
                Op.ADJUST: self._op_adjust,
                Op.PING: self._op_ping,
                Op.CLEAR: self._op_clear,
            }[Op(request.op)]
            handler(connection, request)
        except ProtocolViolation as exc:
            connection.send(Event.error(exc.code, exc.message, exc.request_id))
        except Exception as exc:
            # A bug must cost this request an answer, not the connection or the daemon.
            log.exception("handling %r failed", line[:200])
            connection.send(
                Event.error(
                    ErrorCode.INTERNAL,
                    f"internal error in the daemon: {type(exc).__name__}: {exc}",
                    request.id if request is not None else None,
                )
            )

    def _op_ping(self, connection: Connection, request: Request) -> None:
        from phi4cli.core.paths import install_id

        # The client compares these with its own, and replaces a daemon from another install.
        result = {
            "protocol": protocol.PROTOCOL_VERSION,
            "version": __version__,
            "install": install_id(),
            "settings": {key: getattr(self.settings, key) for key in DAEMON_SETTINGS},
        }
        connection.send(_done(request.id, result))

    def _op_clear(self, connection: Connection, request: Request) -> None:
        cleared = self.engine.clear_prompts()
        # `status` shows the engine's memory as of the worker's last round: an idle worker
        # would show the cache full until its next request.
        memory = self.scheduler.memory
        if "prompt_cache" in memory:
            emptied = {**memory["prompt_cache"], "prompts": 0, "bytes": 0}
            self.scheduler.memory = {**memory, "prompt_cache": emptied}
        connection.send(_done(request.id, {"prompt_cache": cleared}))

    def _op_status(self, connection: Connection, request: Request) -> None:
        connection.send(_done(request.id, self.live_status()))

    def _op_stop(self, connection: Connection, request: Request) -> None:
        # Remove the status file before replying: once the client has the reply it may start a new
        # daemon, which must not find (and trust) ours.
        with contextlib.suppress(FileNotFoundError):
            self.paths.status_file.unlink()
        connection.send(_done(request.id, {"pid": os.getpid()}))
        self.request_shutdown("stop requested")

    def _op_cancel(self, connection: Connection, request: Request) -> None:
        job = _target(connection, request)
        if job is not None:
            self.scheduler.cancel(job)
        connection.send(_done(request.id, {"cancelled": job is not None}))

    def _op_adjust(self, connection: Connection, request: Request) -> None:
        """Change a running or queued request: its ``confidence_floor`` (``--stop-unsure``:
        the client learns it from the question's first samples, after the rest were sent), or
        ``answer_now`` (the user's key while it thinks: the thinking is closed, the model
        answers from what it has)."""
        job = _target(connection, request)
        try:
            floor = protocol.confidence_floor(request.params)
            now = protocol.answer_now(request.params)
        except ProtocolViolation as exc:
            exc.request_id = request.id
            raise
        # Only a request that works out its confidence can be stopped by it.
        adjusted = False
        if job is not None and job.params.confidence and "confidence_floor" in request.params:
            job.confidence_floor = floor  # read by the engine's thread at its next token
            adjusted = True
        if job is not None and now:
            job.answer_now = True  # read by the engine's thread at its next token
            adjusted = True
        connection.send(_done(request.id, {"adjusted": adjusted}))

    def _op_solve(self, connection: Connection, request: Request) -> None:
        if request.id in connection.jobs:
            raise ProtocolViolation(
                ErrorCode.BAD_REQUEST,
                f"request id {request.id!r} is already in use",
                request.id,
            )
        if self._stopping:
            raise ProtocolViolation(
                ErrorCode.SHUTTING_DOWN,
                "the daemon is shutting down; run the command again",
                request.id,
            )
        try:
            params = protocol.parse_params(request.op, request.params, self.asked)
        except ProtocolViolation as exc:
            exc.request_id = request.id
            raise
        if params.keep_alive is not None:
            self.keep_alive = params.keep_alive
        self.last_activity = time.monotonic()
        loop = self._loop
        assert loop is not None

        def emit(event: Event) -> None:
            self._outbox.post(connection, request.id, event)

        # The client it counts as, for the queue's shares: the connection, or the share it
        # names (phi4 serve's HTTP client, whose choices come on connections of their own).
        owner: object = connection if params.share is None else ("share", params.share)
        job = Job(request_id=request.id, params=params, emit=emit, owner=owner)
        try:
            ahead = self.scheduler.submit(job)
        except QueueFullError as exc:
            raise ProtocolViolation(ErrorCode.BUSY, str(exc), request.id) from None
        connection.jobs[request.id] = job
        loading = (
            {"model": str(self.model_path)}
            if self.state in _LOADING and self.model_path is not None
            else {}
        )
        connection.send(
            Event(
                EventKind.ACCEPTED,
                request.id,
                data={"ahead": ahead, "state": self.state, **loading},
            )
        )

    def _undeliverable(self, connection: Connection, request_id: Any, event: Event) -> None:
        log.exception("request %r: cannot deliver a %r event", request_id, event.kind.value)
        job = connection.jobs.pop(request_id, None)
        if job is not None:
            job.emit = _silent  # its answer is the error below: nothing more of it goes out
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
        if beats == self._last_beats and self.state not in _LOADING and not in_step:
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
        if self.keep_alive == FOREVER or self.scheduler.busy or self.state in _LOADING:
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
            loading = self._stopped_in in _LOADING
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


def _silent(event: Event) -> None:
    """The emit of a request that has had its last word."""


def _hashable(request_id: Any) -> Any:
    """A request id as a set member (ids are strings or numbers; anything else by identity)."""
    return request_id if isinstance(request_id, (str, int, float)) else id(request_id)


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


def _target(connection: Connection, request: Request) -> Job | None:
    """The request a cancel or an adjust names (``target``) on this connection; None when it
    has ended or never was."""
    target = request.params.get("target")
    if not isinstance(target, (str, int)) or isinstance(target, bool):
        raise ProtocolViolation.field("target", "must be the id of a request", request.id)
    return connection.jobs.get(target)


def _done(request_id: Any, result: dict[str, Any]) -> Event:
    """The answer to a control op (ping, status, stop, cancel): a done event with its result."""
    return Event(EventKind.DONE, request_id, data={"result": result})
