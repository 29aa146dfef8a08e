"""One interface for whatever answers: the local daemon or a remote OpenAI-compatible server.

``solve``, ``--samples``, ``--file``, ``chat`` and ``serve`` hold a :class:`Backend` and never ask
which one it is. A backend streams one request's events (``stream``), answers many at once
(``run``), and reports its status.
"""

from __future__ import annotations

import _thread
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from phi4cli.config import Settings
from phi4cli.errors import DaemonGoneError
from phi4cli.paths import Paths
from phi4cli.protocol import JSON, ErrorCode, Event, EventKind, Op

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol
else:
    Protocol = object  # the interfaces below are for the type checker; plain classes at run time

Announce = Callable[[str], None]
EventSink = Callable[[int, Event], None]  # (index of the request, event)


class RequestStream(Protocol):
    """The events of one request, ending with exactly one ``done`` or ``error``."""

    def __iter__(self) -> RequestStream: ...

    def __next__(self) -> Event: ...

    def cancel(self) -> None:
        """Ask the engine to stop; the events go on to the terminal one (partial answer kept)."""
        ...

    def close(self) -> None:
        """Hang up: the request is cancelled and no more events come."""
        ...


class Backend(Protocol):
    name: str  # for messages: "the daemon", "the backend URL"

    def stream(self, op: Op, params: JSON) -> RequestStream:
        """Send one solve or chat request and return its events."""
        ...

    def run(self, requests: list[JSON], on_event: EventSink) -> None:
        """Answer many solve requests, passing each event to ``on_event(index, event)``."""
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
        self._lock = _thread.allocate_lock()  # threading's, without importing threading

    def _take(self) -> Any:
        from phi4cli.client import connect_checked

        with self._lock:
            if self._idle:
                return self._idle.pop()
        return connect_checked(self.paths, self.settings, self.model_path, self.announce)

    def _give_back(self, connection: Any) -> None:
        with self._lock:
            self._idle.append(connection)

    def connect(self) -> None:
        self._give_back(self._take())

    def stream(self, op: Op, params: JSON) -> _DaemonStream:
        return _DaemonStream(self, op, params)

    def run(self, requests: list[JSON], on_event: EventSink) -> None:
        from phi4cli.client import solve_many

        solve_many(self.paths, self.settings, self.model_path, requests, on_event,
                   self.announce, window=self.window)  # fmt: skip

    def status(self) -> JSON:
        from phi4cli.client import daemon_status

        return daemon_status(self.paths)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


class _DaemonStream:
    """One request on a connection of its own. A daemon that goes away before the request
    produced anything is replaced, and the request sent again, once: the request carries all
    it needs (a chat its transcript), so a fresh daemon answers it the same.

    An iterator object rather than a generator, so a Ctrl-C while it waits for the next event
    leaves it usable: the caller can ``cancel()`` and read on to the partial answer's end.
    """

    def __init__(self, backend: DaemonBackend, op: Op, params: JSON) -> None:
        self._backend, self._op, self._params = backend, op, params
        self._connection: Any = None
        self._request_id: Any = None
        self._sent = 0
        self._produced = False
        self._finished = False
        self._cancelled_unsent = False
        self.spawned = False  # a daemon was started for this request

    def __iter__(self) -> _DaemonStream:
        return self

    def __next__(self) -> Event:
        if self._finished:
            raise StopIteration
        if self._cancelled_unsent:
            self._finished = True
            return Event.error(ErrorCode.CANCELLED, "cancelled before it was sent")
        while True:
            try:
                if self._connection is None:
                    # Counted before trying: a send that fails counts as an attempt too, so a
                    # daemon that always hangs up is tried twice, not forever.
                    self._sent += 1
                    self._connection = self._backend._take()
                    self.spawned = self.spawned or bool(self._connection.spawned)
                    self._request_id = self._connection.send(self._op, self._params)
                event: Event = self._connection.next_event()
            except DaemonGoneError:
                self.close()
                self._backend.close()
                if self._sent > 1 or self._produced:
                    raise
                again = "restoring the conversation" if self._op == Op.CHAT else "asking again"
                self._backend.announce(f"the daemon stopped; restarting it and {again}...")
                continue
            if event.id is None and event.kind == EventKind.ERROR:
                # The daemon could not read the request at all (a line over its limit): the
                # answer is for us, though it cannot name our id.
                self._finished = True
                self.close()
                return event
            if event.id != self._request_id:
                continue
            if (event.kind == EventKind.ERROR and event.code == ErrorCode.SHUTTING_DOWN
                    and not self._produced and self._sent == 1):  # fmt: skip
                # Refused, or dropped from the queue, by a daemon on its way out: nothing of it
                # was answered, so a fresh daemon can take it.
                self.close()
                self._backend.close()  # its idle connections are to the same daemon
                from phi4cli.client import wait_until_gone

                wait_until_gone(self._backend.paths)
                self._backend.announce("the daemon was shutting down; starting a fresh one...")
                continue
            if event.kind in (EventKind.TOKEN, EventKind.REASONING):
                self._produced = True
            if event.terminal:
                self._finished = True
                connection, self._connection = self._connection, None
                self._backend._give_back(connection)
            return event

    def cancel(self) -> None:
        if self._connection is None and not self._finished:
            self._cancelled_unsent = True  # interrupted while the daemon was starting
        elif self._connection is not None and not self._finished:
            with contextlib.suppress(DaemonGoneError):
                self._connection.send(Op.CANCEL, {"target": self._request_id})

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


# --- a remote server ----------------------------------------------------------------------------


class RemoteBackend:
    """An OpenAI-compatible server; the daemon is not involved."""

    def __init__(
        self,
        url: str,
        model: str,
        api_key: str | None,
        timeout: float,
        deadline: float = 3600.0,
        announce: Announce | None = None,
    ) -> None:
        from phi4cli.remote import RemoteEngine

        self.engine = RemoteEngine(url, model, api_key, timeout, deadline, announce)
        self.name = f"the backend {url}"

    def stream(self, op: Op, params: JSON) -> _RemoteStream:
        return _RemoteStream(self.engine.stream(params))

    def run(self, requests: list[JSON], on_event: EventSink) -> None:
        # A remote server batches as it sees fit; ours are sent one after another.
        for index, params in enumerate(requests):
            for event in self.engine.stream(params):
                on_event(index, event)

    def connect(self) -> None:
        pass  # nothing to start: the first request finds out whether the server answers

    def status(self) -> JSON:
        return {"state": "remote", "backend": self.engine.url, "model": self.engine.model}

    def close(self) -> None:
        pass


class _RemoteStream:
    """A remote request's events; like ``_DaemonStream``, usable after a Ctrl-C."""

    def __init__(self, events: Iterator[Event]) -> None:
        self._events = events
        self._cancelled = False
        self._finished = False

    def __iter__(self) -> _RemoteStream:
        return self

    def __next__(self) -> Event:
        if self._finished:
            raise StopIteration
        if not self._cancelled:
            with contextlib.suppress(StopIteration):
                event = next(self._events)
                self._finished = event.terminal
                return event
        self._finished = True
        if self._cancelled:
            return Event.error(ErrorCode.CANCELLED, "cancelled")
        return Event.error(ErrorCode.BACKEND_ERROR, "the backend's stream ended early")

    def cancel(self) -> None:
        # Closing the HTTP response is the only way to stop an OpenAI-compatible server.
        self._cancelled = True
        self.close()

    def close(self) -> None:
        close = getattr(self._events, "close", None)
        if close is not None:
            close()


def make_backend(
    paths: Paths, settings: Settings, model: Path | str, announce: Announce
) -> Backend:
    """The backend the settings ask for: ``settings.backend`` (a URL) or the local daemon."""
    if settings.backend:
        from phi4cli.remote import backend_key

        return RemoteBackend(settings.backend, str(model), backend_key(),
                             settings.backend_timeout, settings.backend_deadline,
                             announce)  # fmt: skip
    return DaemonBackend(paths, settings, Path(model), announce)
