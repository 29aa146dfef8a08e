"""The one request path: a list of requests (or a single one) over one or more replicas.

Every command that asks for answers goes through a :class:`Flight`: ``solve``, ``--samples``,
``--file`` and ``eval`` as a run of many, ``chat``, ``serve`` and ``warm`` as a stream of one. The
replicas are :class:`Replica` objects: the local daemon (one connection, many requests on it), or
one or more remote OpenAI-compatible servers (a thread per request in flight). The flight keeps,
for all of them alike:

- a window: at most ``replica.window`` requests in flight on each replica, sent to the replica
  with the fewest in flight; a replica that answers busy gets a smaller window for a while, and
  the window grows back by one with each answer;
- exactly one terminal event per request, handed out in the order they come, with
  ``(index, event)``;
- cancellation of one request or all (a request not yet sent ends ``cancelled`` at once);
- one resend rule: work that a replica failed (it went away, hung up mid-stream, was shutting
  down) is sent again, to another replica where there is one, up to ``1 + len(replicas)`` sends in
  all. A request that had already produced text is sent again only when the caller folds events
  (``restart=True``): it first gets a ``restart`` event, which voids what came before, so the
  output never holds an answer twice. Otherwise it ends with the failure's error.

A replica that failed is down until it recovers: the daemon is replaced by a fresh one (once per
flight), a remote server gets health probes before it is given work again. A replica that never
answered anything in this flight and cannot be reached is dead at once, so a wrong URL fails in
one step; when every replica is dead and none ever answered, the flight raises the failure
(``cannot reach ...``: exit status 3) instead of giving every request the same error record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from phi4cli.core.protocol import JSON, ErrorCode, Event, SolveParams

EventSink = Callable[[int, Event], None]  # (index of the request, event)
# What says one line to the user (without its ``phi4:``), handed to a backend by the client:
# ``exits.say``, an ``Environment``'s notice, a progress bar's line above itself.
Announce = Callable[[str], None]
# The longest the flight blocks on its inbox at once: a Ctrl-C is seen at least this often, and
# a replica's busy pause ends on time.
POLL_S = 0.5


class Failure:
    """An attempt that ended without its terminal event, and what that says of its replica."""

    __slots__ = ("code", "down", "draining", "elsewhere", "message", "stats")

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        down: bool = False,
        draining: bool = False,
        elsewhere: bool = False,
        stats: Event | None = None,
    ) -> None:
        self.code, self.message = code, message
        self.stats = stats  # the attempt's stats event, given before the error if it is the end
        self.down = down  # the replica is gone: nothing more goes to it until it recovers
        self.draining = draining  # it takes no new work, and ends what it has (a daemon stopping)
        self.elsewhere = elsewhere  # worth sending again only to another replica (busy for good)

    def event(self) -> Event:
        return Event.error(self.code, self.message)


class Slow:
    """A replica answered busy (429, 503, the daemon's queue full): take less to it for ``wait``
    seconds. ``requeue`` when the attempt is over and is to be sent again (not counted)."""

    __slots__ = ("requeue", "wait")

    def __init__(self, wait: float, requeue: bool = False) -> None:
        self.wait, self.requeue = wait, requeue


class Probe:
    """The end of a replica's recovery: up again, or given up on (``reason`` why)."""

    __slots__ = ("reason", "up")

    def __init__(self, up: bool, reason: Failure | None = None) -> None:
        self.up, self.reason = up, reason


# What an inbox hands the flight: the replica, the attempt's serial (None: every attempt on that
# replica), and an event or a note on the attempt.
Delivery = tuple["Replica", "int | None", "Event | Failure | Slow | Probe"]


class Closing(Protocol):
    """What a replica's recovery reads of its flight (a ``flight.Flight``): whether it is over."""

    @property
    def closed(self) -> bool: ...


class Feed(Protocol):
    """Requests that are still coming (lines read from a pipe): the flight's ``requests``
    grows as they do, and ``ended`` says that no more will come."""

    ended: bool

    def wait(self, timeout: float) -> None:
        """Until a request is added or the feed ends, at most ``timeout`` seconds."""


class Inbox(Protocol):
    def get(self, timeout: float | None) -> Delivery | None:
        """The next delivery, or None when ``timeout`` passed first."""
        ...


UP, DRAINING, DOWN, DEAD = "up", "draining", "down", "dead"


class Replica:
    """One server a request can go to: its window and its counts. The transport is the
    subclass's: ``send`` starts an attempt whose events reach the flight's inbox."""

    name: str = "the server"

    def __init__(self, window: int) -> None:
        self.limit = self.window = max(1, window)
        self.in_flight: set[int] = set()  # serials
        self.state = UP
        self.not_before = 0.0  # busy: nothing new before this (time.monotonic())
        self.recovering = False
        self.worked = False  # it answered something in this flight
        self.last_failure: Failure | None = None
        self.sent = self.answered = self.failed = self.tokens = 0

    def room(self, now: float) -> int:
        if self.state != UP or now < self.not_before:
            return 0
        return self.window - len(self.in_flight)

    # --- transport ---------------------------------------------------------------------------

    def send(self, serial: int, op: str, params: SolveParams) -> None:
        raise NotImplementedError

    def cancel(self, serial: int) -> Event | None:
        """Ask the engine to stop attempt ``serial``. Return its terminal event when the engine
        will not send one (a remote stream is hung up), else None: it comes as usual."""
        raise NotImplementedError

    def adjust(self, serial: int, floor: float) -> None:
        """Set attempt ``serial``'s ``confidence_floor``, as far as the engine can while it
        runs; an engine that cannot does nothing."""

    def answer_now(self, serial: int) -> None:
        """Have attempt ``serial``'s engine close the thinking so the model answers from what
        it has (the thinking policy's answer now); an engine that cannot does nothing."""

    def flush(self) -> None:
        """The flight has sent what it will this round: send what was held to go together."""

    def may_recover(self, failure: Failure) -> bool:
        """Whether, after ``failure``, a recovery may bring this replica back."""
        return True

    def recover(self, flight: Closing) -> None:
        """Start getting usable again; a ``Probe`` delivery to the flight's inbox says how it
        went."""
        raise NotImplementedError

    def close(self, idle: bool) -> None:
        """The flight is over (``idle``: nothing of it is still running here)."""

    def summary(self, elapsed: float) -> JSON:
        """What it did in a flight that has run ``elapsed`` seconds."""
        rate = self.tokens / elapsed if elapsed > 0 else None
        return {
            "replica": self.name,
            "state": self.state,
            "in_flight": len(self.in_flight),
            "sent": self.sent,
            "answered": self.answered,
            "failed": self.failed,
            "tokens": self.tokens,
            "tokens_per_s": None if rate is None else round(rate, 1),
        }
