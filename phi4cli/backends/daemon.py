"""The local daemon as a backend: started when needed, its requests over one connection (a
flight's one replica, replaced by a fresh daemon when it goes away)."""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phi4cli.backends.dispatch import (
    Announce,
    Closing,
    Delivery,
    EventSink,
    Failure,
    Feed,
    Probe,
    Replica,
    Slow,
)
from phi4cli.backends.flight import Flight, FlightHook, FlightStream
from phi4cli.core.config import Settings
from phi4cli.core.errors import DaemonGoneError, RequestError
from phi4cli.core.paths import Paths
from phi4cli.core.protocol import JSON, ErrorCode, Event, EventKind, Op, SolveParams, to_wire


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
        from phi4cli.backends.daemon_link import connect_checked

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
        from phi4cli.backends.daemon_link import daemon_status

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
            from phi4cli.backends.daemon_link import BUSY_RETRY_S

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

    def recover(self, flight: Closing) -> None:
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
            from phi4cli.backends.daemon_link import wait_until_gone

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
