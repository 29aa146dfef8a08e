"""One interface for whatever answers: the local daemon, or remote OpenAI-compatible servers.

``solve``, ``--samples``, ``--file``, ``chat`` and ``serve`` hold a :class:`Backend` and never ask
which one it is. A backend streams one request's events (``stream``), answers many at once
(``run``), and reports its status. Both go through the one request path, a
:class:`~phi4cli.backends.flight.Flight` over replicas: here the daemon as one
(``DaemonReplica``); the remote servers' replicas are in ``phi4cli.backends.replicas``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from phi4cli.backends.dispatch import Announce, EventSink, Feed
from phi4cli.backends.flight import FlightHook
from phi4cli.core.config import Settings
from phi4cli.core.paths import Paths
from phi4cli.core.protocol import JSON, Event, EventKind, Op, SolveParams


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


def make_backend(
    paths: Paths,
    settings: Settings,
    model: Path | str,
    announce: Announce,
) -> Backend:
    """The backend the settings ask for: ``settings.backend`` (a URL) or the local daemon."""
    if settings.backend:
        from phi4cli.backends.remote import backend_key
        from phi4cli.backends.remote_backend import RemoteBackend

        return RemoteBackend(
            list(settings.backend),
            str(model),
            backend_key(),
            settings.backend_timeout,
            settings.backend_deadline,
            announce,
            settings.backend_concurrency,
        )
    from phi4cli.backends.daemon import DaemonBackend

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
    from phi4cli.backends.daemon import DaemonBackend

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
