"""The daemon's clients: a connection (its requests, the lines held to write in one go), who may
connect, and the outbox that carries the engine thread's events to the event loop."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from phi4cli.core import protocol
from phi4cli.core.paths import peer_uid
from phi4cli.core.protocol import Event
from phi4cli.daemon.jobs import Job

log = logging.getLogger("phi4.daemon")


def peer_allowed(sock: socket.socket, own_uid: int) -> bool:
    """Return True when the peer runs as ``own_uid``; the socket's 0600 mode is the first guard."""
    uid = peer_uid(sock)
    return uid is None or uid == own_uid


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


class Outbox:
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


def silent(event: Event) -> None:
    """The emit of a request that has had its last word."""


def _hashable(request_id: Any) -> Any:
    """A request id as a set member (ids are strings or numbers; anything else by identity)."""
    return request_id if isinstance(request_id, (str, int, float)) else id(request_id)
