"""The daemon's operations table: what each op of the protocol does (solve, chat and load queue a
request; ping, status, stop, cancel, adjust and clear answer at once), one handler each."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

from phi4cli import __version__
from phi4cli.core import protocol
from phi4cli.core._settings import Ask
from phi4cli.core.config import DAEMON_SETTINGS
from phi4cli.core.protocol import ErrorCode, Event, EventKind, Op, ProtocolViolation, Request
from phi4cli.daemon.connections import Connection, Outbox
from phi4cli.daemon.jobs import Engine, Job
from phi4cli.daemon.scheduler import QueueFullError
from phi4cli.daemon.status import StatusReport

log = logging.getLogger("phi4.daemon")

LOADING = ("loading", "warming")


class Operations(StatusReport):
    """The ops, as a part of :class:`~phi4cli.daemon.server.DaemonServer`: ``_dispatch`` reads a
    request line and hands it to its op's handler; a request that breaks the protocol is answered
    with its error, and a handler that fails costs its request only."""

    # (Beside the state StatusReport reads.)
    asked: Ask
    engine: Engine
    _outbox: Outbox
    _loop: asyncio.AbstractEventLoop | None

    def request_shutdown(self, reason: str) -> None:
        """Stop the daemon (the server's own: its life is not the ops')."""
        raise NotImplementedError

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
            if self.state in LOADING and self.model_path is not None
            else {}
        )
        connection.send(
            Event(
                EventKind.ACCEPTED,
                request.id,
                data={"ahead": ahead, "state": self.state, **loading},
            )
        )


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
