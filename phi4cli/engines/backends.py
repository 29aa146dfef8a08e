"""One interface for whatever answers: the local daemon, or remote OpenAI-compatible servers.

``solve``, ``--samples``, ``--file``, ``chat`` and ``serve`` hold a :class:`Backend` and never ask
which one it is. A backend streams one request's events (``stream``), answers many at once
(``run``), and reports its status. Both go through the one request path, a
:class:`~phi4cli.engines.dispatch.Flight` over replicas: here the daemon as one
(``DaemonReplica``); the remote servers' replicas are in ``phi4cli.engines.replicas``.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from phi4cli.core.config import Settings
from phi4cli.core.errors import DaemonGoneError, RequestError
from phi4cli.core.paths import Paths
from phi4cli.core.protocol import JSON, ErrorCode, Event, EventKind, Op, SolveParams, to_wire
from phi4cli.engines.dispatch import (
    Announce,
    Delivery,
    EventSink,
    Failure,
    Feed,
    Flight,
    FlightHook,
    FlightStream,
    Probe,
    Replica,
    Slow,
)


class RequestStream(Protocol):
    """The events of one request, ending with exactly one ``done`` or ``error``."""

    def __iter__(self) -> RequestStream: ...

    def __next__(self) -> Event: ...

    def cancel(self) -> None:
        """Ask the engine to stop; the events go on to the terminal one (partial answer kept)."""
        ...

    def answer_now(self) -> None:
        """Ask the engine to close the thinking so the model answers from what it has (as a
        think budget reached does); nothing changes once the thinking is over."""
        ...

    def close(self) -> None:
        """Hang up: the request is cancelled and no more events come."""
        ...


class Backend(Protocol):
    name: str  # for messages: "the daemon", "the backend URL"

    def stream(self, op: Op, params: SolveParams) -> RequestStream:
        """Send one solve or chat request and return its events."""
        ...

    def run(
        self,
        requests: Sequence[SolveParams | Event],
        on_event: EventSink,
        restart: bool = False,
        feed: Feed | None = None,
        on_flight: FlightHook | None = None,
    ) -> None:
        """Answer many solve requests, passing each event to ``on_event(index, event)``. With
        ``restart``, a request cut off mid-answer may be sent again after a ``restart`` event
        (the caller folds events and can drop what came before). With a ``feed``, ``requests``
        grows as the feed adds to it, until it ends (lines read from a pipe); a request that is
        an error event is not sent, and ends with it. ``on_flight`` is handed the flight before
        anything is sent, so that ``on_event`` may cancel requests it no longer needs."""
        ...

    def connect(self) -> None:
        """Get ready now (start the daemon, load the model) rather than on the first request."""
        ...

    def status(self) -> JSON: ...

    def close(self) -> None: ...


# --- the local daemon ---------------------------------------------------------------------------


class DaemonBackend:
    """The resident daemon over its Unix socket, started when needed."""

    name = "the daemon"

    def __init__(
        self,
        paths: Paths,
        settings: Settings,
        model_path: Path,
        announce: Announce,
        window: int = 32,  # the daemon's per-connection share of its default queue (64 // 2)
    ) -> None:
        self.paths, self.settings, self.model_path = paths, settings, model_path
        self.announce = announce
        self.window = window  # requests one `run` keeps in the daemon's queue at once
        self._idle: list[Any] = []  # connections between requests, reused
        self._lock = threading.Lock()

    def _take(self) -> Any:
        from phi4cli.engines.daemon_link import connect_checked

        with self._lock:
            if self._idle:
                return self._idle.pop()
        return connect_checked(self.paths, self.settings, self.model_path, self.announce)

    def _give_back(self, connection: Any) -> None:
        with self._lock:
            self._idle.append(connection)

    def connect(self) -> None:
        self._give_back(self._take())

    def _flight(
        self,
        op: Op,
        requests: Sequence[SolveParams | Event],
        window: int,
        restart: bool,
        feed: Feed | None = None,
    ) -> Flight:
        replica = DaemonReplica(self, window)
        return Flight(requests, [replica], replica, op=op, restart=restart, feed=feed)

    def stream(self, op: Op, params: SolveParams) -> FlightStream:
        return FlightStream(self._flight(op, [params], 1, restart=False))

    def run(
        self,
        requests: Sequence[SolveParams | Event],
        on_event: EventSink,
        restart: bool = False,
        feed: Feed | None = None,
        on_flight: FlightHook | None = None,
    ) -> None:
        flight = self._flight(Op.SOLVE, requests, self.window, restart, feed)
        if on_flight is not None:
            on_flight(flight)
        flight.run(on_event)

    def status(self) -> JSON:
        from phi4cli.engines.daemon_link import daemon_status

        return daemon_status(self.paths)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


class DaemonReplica(Replica):
    """The daemon as a flight's one replica: its requests share one connection, and the
    daemon's events are read from it as the flight asks (no thread). A daemon that goes away
    is replaced by a fresh one, once per flight: a request carries all it needs (a chat its
    transcript), so the fresh daemon answers it the same."""

    name = "the daemon"

    def __init__(self, backend: DaemonBackend, window: int) -> None:
        super().__init__(window)
        self.backend = backend
        self.connection: Any = None
        self.serial_of: dict[Any, int] = {}  # the daemon's request id -> serial
        self.id_of: dict[int, Any] = {}  # serial -> request id
        self.pending: deque[Delivery] = deque()  # said before the connection is read again
        self.recoveries = 0
        self.spawned = False  # a daemon was started for this flight
        self.op: str = Op.SOLVE

    def room(self, now: float) -> int:
        return 0 if self.pending else super().room(now)

    def send(self, serial: int, op: str, params: SolveParams) -> None:
        self.op = op
        if self.connection is None:
            self.connection = self.backend._take()
            self.spawned = self.spawned or bool(self.connection.spawned)
        try:
            request_id = self.connection.send(op, to_wire(op, params))
        except DaemonGoneError as exc:
            self._gone(exc)  # the failure covers this request too
            return
        except RequestError as exc:  # longer than the daemon takes: this request's answer
            self.pending.append((self, serial, Event.error(ErrorCode.BAD_REQUEST, str(exc))))
            return
        self.serial_of[request_id], self.id_of[serial] = serial, request_id

    def _gone(self, exc: Exception) -> None:
        self._drop_connection()
        self.backend.close()  # its idle connections are to the same daemon
        self.pending.append(
            (
                self,
                None,
                Failure(
                    ErrorCode.SHUTTING_DOWN, f"the daemon went away mid-answer: {exc}", down=True
                ),
            )
        )

    def _drop_connection(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None
        self.serial_of.clear()
        self.id_of.clear()

    def get(self, timeout: float | None) -> Delivery | None:
        """The next delivery: the daemon's events are read as they come (its heartbeats keep a
        live connection from being silent), so ``timeout`` is not needed here."""
        if self.pending:
            return self.pending.popleft()
        if self.connection is None:
            return None
        try:
            event: Event = self.connection.next_event()
        except DaemonGoneError as exc:
            self._gone(exc)
            return self.pending.popleft()
        request_id = event.id
        if request_id is None and event.kind == EventKind.ERROR and len(self.id_of) == 1:
            # The daemon could not read a request at all (a line over its limit): it cannot
            # name the id, but only one is ours.
            request_id = next(iter(self.id_of.values()))
        serial = self.serial_of.get(request_id)
        if serial is None:
            return None
        code = event.code if event.kind == EventKind.ERROR else None
        if event.terminal:
            del self.serial_of[request_id], self.id_of[serial]
        if code == ErrorCode.BUSY:
            # Its queue is full (other clients too): keep fewer in flight, send this one later.
            from phi4cli.engines.daemon_link import BUSY_RETRY_S

            return self, serial, Slow(BUSY_RETRY_S, requeue=True)
        if code == ErrorCode.SHUTTING_DOWN:
            # Refused, dropped from the queue or cut short by a daemon on its way out: a fresh
            # daemon can take it (from the start).
            return self, serial, Failure(code, event.message, draining=True)
        return self, serial, event

    def cancel(self, serial: int) -> Event | None:
        request_id = self.id_of.get(serial)
        if self.connection is not None and request_id is not None:
            with contextlib.suppress(DaemonGoneError):
                self.connection.send(Op.CANCEL, {"target": request_id})
        return None  # the daemon ends it, with the partial answer

    def adjust(self, serial: int, floor: float) -> None:
        request_id = self.id_of.get(serial)
        if self.connection is not None and request_id is not None:
            with contextlib.suppress(DaemonGoneError):
                self.connection.send(Op.ADJUST, {"target": request_id, "confidence_floor": floor})

    def answer_now(self, serial: int) -> None:
        request_id = self.id_of.get(serial)
        if self.connection is not None and request_id is not None:
            with contextlib.suppress(DaemonGoneError):
                self.connection.send(Op.ADJUST, {"target": request_id, "answer_now": True})

    def may_recover(self, failure: Failure) -> bool:
        return self.recoveries < 1

    def recover(self, flight: Flight) -> None:
        self.recoveries += 1
        if self.recoveries > 1:
            self.pending.append(
                (
                    self,
                    None,
                    Probe(
                        False,
                        Failure(
                            ErrorCode.SHUTTING_DOWN,
                            "the daemon stopped twice while answering; see its log",
                        ),
                    ),
                )
            )
            return
        draining = self.state == "draining"
        self._drop_connection()
        self.backend.close()
        if draining:
            from phi4cli.engines.daemon_link import wait_until_gone

            wait_until_gone(self.backend.paths)
            self.backend.announce("the daemon was shutting down; starting a fresh one...")
        else:
            again = "restoring the conversation" if self.op == Op.CHAT else "asking again"
            self.backend.announce(f"the daemon stopped; restarting it and {again}...")
        self.pending.append((self, None, Probe(True)))

    def close(self, idle: bool) -> None:
        if self.connection is None:
            return
        if idle and not self.pending:
            self.backend._give_back(self.connection)
            self.connection = None
        else:
            self._drop_connection()  # hanging up cancels what still runs


# --- remote servers -----------------------------------------------------------------------------


class RemoteBackend:
    """One or more OpenAI-compatible servers (replicas of one model); no daemon involved."""

    def __init__(
        self,
        urls: list[str] | str,
        model: str,
        api_key: str | None,
        timeout: float,
        deadline: float = 3600.0,
        announce: Announce | None = None,
        concurrency: int = 16,
    ) -> None:
        from phi4cli.engines.remote import RemoteEngine

        urls = [urls] if isinstance(urls, str) else urls
        self.engines = [
            RemoteEngine(url, model, api_key, timeout, deadline, announce, connections=concurrency)
            for url in urls
        ]
        self.engine = self.engines[0]
        self.concurrency = concurrency
        self.announce = announce
        shown = (
            " and ".join(e.url for e in self.engines)
            if len(urls) <= 3
            else f"{self.engine.url} and {len(urls) - 1} more"
        )
        self.name = f"the backend {shown}"
        self.last_summary: list[JSON] = []

    def _flight(
        self,
        op: Op,
        requests: Sequence[SolveParams | Event],
        restart: bool,
        feed: Feed | None = None,
    ) -> Flight:
        from phi4cli.engines.replicas import RemoteReplica, ReplicaInbox

        inbox = ReplicaInbox()
        replicas: list[Replica] = [
            RemoteReplica(engine, self.concurrency, inbox) for engine in self.engines
        ]
        return Flight(requests, replicas, inbox, op=op, restart=restart, feed=feed)

    def stream(self, op: Op, params: SolveParams) -> FlightStream:
        return FlightStream(self._flight(op, [params], restart=False))

    def run(
        self,
        requests: Sequence[SolveParams | Event],
        on_event: EventSink,
        restart: bool = False,
        feed: Feed | None = None,
        on_flight: FlightHook | None = None,
    ) -> None:
        flight = self._flight(Op.SOLVE, requests, restart, feed)
        if on_flight is not None:
            on_flight(flight)
        try:
            flight.run(on_event)
        finally:
            self.last_summary = flight.summary()
        if len(self.engines) > 1 and self.announce is not None and len(requests) > 1:
            self.announce("replicas: " + "; ".join(_replica_line(r) for r in self.last_summary))

    def connect(self) -> None:
        pass  # nothing to start: the first request finds out whether the server answers

    def status(self) -> JSON:
        from phi4cli.engines.replicas import probe_all

        replicas = probe_all(self.engines)
        up = sum(1 for r in replicas if r["state"] == "up")
        # What the servers serve (a llama-server answers any model name with its one model),
        # where every replica that lists its models lists the same one; else the name asked.
        served = {tuple(r["models"]) for r in replicas if r.get("models")}
        only = next(iter(served)) if len(served) == 1 else ()
        model = only[0] if len(only) == 1 else self.engine.model
        return {
            "state": "remote" if up else "down",
            "backend": self.engine.url,
            "model": model,
            "model_asked": self.engine.model,
            "replicas": replicas,
        }

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


def _replica_line(part: JSON) -> str:
    rate = f", {part['tokens_per_s']:g} tokens/s" if part["tokens_per_s"] else ""
    line = f"{part['replica']} answered {part['answered']}{rate}"
    if part["failed"]:
        line += f", {part['failed']} failed"
    return line + (f" ({part['state']})" if part["state"] != "up" else "")


def make_backend(
    paths: Paths,
    settings: Settings,
    model: Path | str,
    announce: Announce,
) -> Backend:
    """The backend the settings ask for: ``settings.backend`` (a URL) or the local daemon."""
    if settings.backend:
        from phi4cli.engines.remote import backend_key

        return RemoteBackend(
            list(settings.backend),
            str(model),
            backend_key(),
            settings.backend_timeout,
            settings.backend_deadline,
            announce,
            settings.backend_concurrency,
        )
    return DaemonBackend(paths, settings, Path(model), announce)


def load_model(
    paths: Paths, settings: Settings, model_path: Path, set_keep_alive: bool, announce: Announce
) -> tuple[dict[str, Any], bool]:
    """Have the daemon (started if need be) load and warm ``model_path``; return its load
    timings and whether this call started the daemon."""
    params = SolveParams(
        "",
        model=str(model_path),
        load_only=True,
        keep_alive=settings.keep_alive if set_keep_alive else None,
    )
    # Through the backend, so a daemon on its way out is replaced as for any request.
    backend = DaemonBackend(paths, settings, model_path, announce)
    try:
        stream = backend.stream(Op.LOAD, params)
        *_, terminal = stream
    finally:
        backend.close()
    if terminal.kind == EventKind.ERROR:
        raise terminal.exception()
    return terminal.result, stream.spawned
