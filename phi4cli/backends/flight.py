"""A flight: requests on their way through replicas (see ``dispatch`` for the rules it keeps),
and ``FlightStream``, one request of a flight as a stream."""

from __future__ import annotations

import itertools
import time
from bisect import insort
from collections import deque
from collections.abc import Callable, Sequence

from phi4cli.backends.dispatch import (
    DEAD,
    DOWN,
    DRAINING,
    POLL_S,
    UP,
    EventSink,
    Failure,
    Feed,
    Inbox,
    Probe,
    Replica,
    Slow,
)
from phi4cli.core.errors import error_for
from phi4cli.core.protocol import JSON, ErrorCode, Event, EventKind, SolveParams

FlightHook = Callable[["Flight"], None]  # handed a flight before it sends: to cancel with


class Flight:
    """Requests on their way through replicas; iterate it for ``(index, event)``."""

    def __init__(
        self,
        requests: Sequence[SolveParams | Event],
        replicas: list[Replica],
        inbox: Inbox,
        *,
        op: str = "solve",
        restart: bool = False,
        feed: Feed | None = None,
    ) -> None:
        assert replicas, "a flight needs a replica"
        self.requests, self.replicas, self.inbox = requests, replicas, inbox
        self.op, self.restart, self.feed = op, restart, feed
        self.max_sends = 1 + len(replicas)
        self.known = len(requests)  # the requests seen so far (a feed adds more)
        self.waiting: deque[int] = deque(range(self.known))
        self.sends: dict[int, int] = {}  # index -> times sent (a busy refusal not counted)
        self.avoid: dict[int, set[Replica]] = {}  # index -> replicas busy for good for it
        self.produced: set[int] = set()
        self.live: dict[int, tuple[int, Replica]] = {}  # serial -> (index, replica)
        self.serial_of: dict[int, int] = {}  # index -> its live serial
        self.ready: deque[tuple[int, Event]] = deque()
        # The requests known and not ended yet: a run of a million keeps a window's worth.
        self.open: set[int] = set(range(self.known))
        self.closed = False
        self.cancelled: set[int] = set()  # asked to stop: never sent again
        self.adjusted: dict[int, float] = {}  # index -> confidence floor set since (sent with it)
        self.hurried: set[int] = set()  # asked to answer now (a later send is asked again)
        self.last_failure: Failure | None = None  # the latest seen, for what cannot be sent
        self.began = time.monotonic()
        self._serials = itertools.count(1)

    # --- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> Flight:
        return self

    def __next__(self) -> tuple[int, Event]:
        while not self.ready:
            if self._pull() and not self.open:
                raise StopIteration
            self._step()
        return self.ready.popleft()

    def _pull(self) -> bool:
        """Take in the requests a feed added; whether all there will be are in."""
        ended = self.feed is None or self.feed.ended  # read first: more may come before it
        count = len(self.requests)
        if count > self.known:
            self.waiting.extend(range(self.known, count))
            self.open.update(range(self.known, count))
            self.known = count
        return ended

    def run(self, on_event: EventSink) -> None:
        """Hand every event to ``on_event``; whatever happens, close the flight (an interrupt
        cancels every request still running)."""
        try:
            for index, event in self:
                on_event(index, event)
        finally:
            self.close()

    def _step(self) -> None:
        self._fill()
        if self.ready:
            return
        now = time.monotonic()
        if self.live or any(r.recovering for r in self.replicas):
            delivery = self.inbox.get(self._timeout(now))
            if delivery is not None:
                self._take(*delivery)
            return
        if not self.waiting and self.feed is not None:
            ended = self._pull()
            if self.waiting:
                return  # more came meanwhile: the next step sends it
            if not ended:
                self.feed.wait(POLL_S)  # all answered so far; more is coming
                return
        if not self.waiting:
            # Nothing waits, runs or recovers, yet not all have ended (an interrupt between
            # two steps of the bookkeeping): end those rather than wait for nothing.
            for index in sorted(self.open):
                self._finish(
                    index, Event.error(ErrorCode.INTERNAL, "the request was lost on its way")
                )
            return
        paused = [r.not_before for r in self.replicas if r.state == UP and r.not_before > now]
        if paused:
            time.sleep(min(min(paused) - now, POLL_S))
            return
        self._recover_idle()
        if any(r.recovering for r in self.replicas):
            return
        self._give_up()

    def _timeout(self, now: float) -> float:
        paused = [r.not_before - now for r in self.replicas if r.not_before > now]
        return max(0.0, min([POLL_S, *paused]))

    def _fill(self) -> None:
        try:
            self._send_what_fits()
        finally:
            for replica in self.replicas:
                replica.flush()

    def _send_what_fits(self) -> None:
        now = time.monotonic()
        while self.waiting:
            chosen = self._choose(now)
            if chosen is None:
                return
            replica, index = chosen
            request = self.requests[index]
            if isinstance(request, Event):  # refused before sending: its error is its end
                self.waiting.remove(index)
                self._finish(index, request)
                continue
            if index in self.adjusted:
                request = request._replace(confidence_floor=self.adjusted[index])
            serial = next(self._serials)
            self.live[serial] = (index, replica)
            self.serial_of[index] = serial
            replica.in_flight.add(serial)
            if self.waiting[0] == index:
                self.waiting.popleft()
            else:
                self.waiting.remove(index)
            try:
                replica.send(serial, self.op, request)
            except BaseException:
                # Not sent (an interrupt while the daemon starts, say): it is waiting again.
                self._forget(serial)
                self.waiting.appendleft(index)
                raise
            self.sends[index] = self.sends.get(index, 0) + 1
            replica.sent += 1
            if index in self.hurried:
                replica.answer_now(serial)

    def _choose(self, now: float) -> tuple[Replica, int] | None:
        """The replica with the fewest in flight that has room, and the first waiting request
        it may take (one it was busy for goes to another)."""
        open_ = sorted(
            (r for r in self.replicas if r.room(now) > 0), key=lambda r: len(r.in_flight)
        )
        for replica in open_:
            if not self.avoid:
                return replica, self.waiting[0]
            for index in self.waiting:
                if replica not in self.avoid.get(index, ()):
                    return replica, index
        return None

    def _forget(self, serial: int) -> tuple[int, Replica] | None:
        entry = self.live.pop(serial, None)
        if entry is not None:
            index, replica = entry
            replica.in_flight.discard(serial)
            if self.serial_of.get(index) == serial:
                del self.serial_of[index]
        return entry

    # --- what the replicas said --------------------------------------------------------------

    def _take(self, replica: Replica, serial: int | None, item: object) -> None:
        if isinstance(item, Probe):
            self._probed(replica, item)
        elif isinstance(item, Slow):
            self._slow(replica, serial, item)
        elif isinstance(item, Failure):
            serials = (
                [s for s, (_i, r) in self.live.items() if r is replica]
                if serial is None
                else [serial]
            )
            serials = [s for s in serials if s in self.live]
            if not serials:
                return  # an attempt already ended (cancelled): it says nothing of the replica
            self.last_failure = item
            for each in serials:
                self._failed(each, item)
            self._mark(replica, item)
        elif isinstance(item, Event) and serial in self.live:
            self._event(serial, item)

    def _event(self, serial: int, event: Event) -> None:
        index, replica = self.live[serial]
        kind = event.kind
        if kind in (EventKind.TOKEN, EventKind.REASONING):
            self.produced.add(index)
            replica.worked = True
        elif kind == EventKind.STATS:
            replica.tokens += event.stats.completion_tokens
        if kind.terminal:
            self._forget(serial)
            replica.worked = True
            if kind == EventKind.DONE:
                replica.answered += 1
            # After a busy answer the window shrank; it grows back as requests complete.
            replica.window = min(replica.limit, replica.window + 1)
            self._settle(index)
        self.ready.append((index, event))
        if kind.terminal and replica.state != UP:
            self._recover_idle()  # a draining daemon, say, whose last answer just ended

    def _slow(self, replica: Replica, serial: int | None, slow: Slow) -> None:
        others = len(replica.in_flight) - (serial in replica.in_flight)
        replica.window = max(1, others // 2 if not slow.requeue else others)
        replica.not_before = max(replica.not_before, time.monotonic() + slow.wait)
        if slow.requeue and serial is not None:
            entry = self._forget(serial)
            if entry is not None:
                index = entry[0]
                self.sends[index] -= 1  # a refusal is not an attempt
                replica.sent -= 1
                if index in self.cancelled:
                    self._finish(index, Event.error(ErrorCode.CANCELLED, "cancelled"))
                else:
                    self.waiting.appendleft(index)

    def _failed(self, serial: int, failure: Failure) -> None:
        entry = self._forget(serial)
        if entry is None:
            return
        index, replica = entry
        replica.failed += 1
        if index in self.cancelled:  # its engine failed before the cancel was confirmed
            self._finish(index, Event.error(ErrorCode.CANCELLED, "cancelled"))
            return
        produced = index in self.produced
        again = self.sends.get(index, 0) < self.max_sends and (not produced or self.restart)
        if failure.elsewhere:
            self.avoid.setdefault(index, set()).add(replica)
        if again and not self._someone_for(index, replica, failure):
            again = False
        if not again:
            if (
                failure.code == ErrorCode.UNREACHABLE
                and not self.live
                and not any(r.worked for r in self.replicas)
            ):
                # No engine could be reached at all: that is the command's one error, not the
                # same record for every request.
                raise error_for(failure.code, failure.message)
            if failure.stats is not None:
                self.ready.append((index, failure.stats))
            self._finish(index, failure.event())
            return
        if produced:
            self.produced.discard(index)
            self.ready.append((index, Event(EventKind.RESTART)))
        insort(self.waiting, index)

    def _someone_for(self, index: int, failing: Replica, failure: Failure) -> bool:
        """Whether a replica may still take request ``index``, which ``failing`` could not do."""
        avoided = self.avoid.get(index, set())
        others = any(
            r is not failing and r.state != DEAD and r not in avoided for r in self.replicas
        )
        if failure.elsewhere:
            return others
        return others or failing.may_recover(failure)

    def _mark(self, replica: Replica, failure: Failure) -> None:
        replica.last_failure = failure
        if failure.down:
            replica.state = DOWN
        elif failure.draining and replica.state == UP:
            replica.state = DRAINING
        self._recover_idle()

    def _recover_idle(self) -> None:
        if not self.waiting:
            return  # nothing to send again: a recovery would only cost time
        for replica in self.replicas:
            if (
                replica.state in (DOWN, DRAINING)
                and not replica.in_flight
                and not replica.recovering
            ):
                replica.recovering = True
                replica.recover(self)

    def _probed(self, replica: Replica, probe: Probe) -> None:
        replica.recovering = False
        if probe.up:
            replica.state = UP
            replica.window = replica.limit
            return
        replica.state = DEAD
        if probe.reason is not None:
            replica.last_failure = probe.reason

    def _give_up(self) -> None:
        """Nothing is in flight, work waits, and no replica will take it: every replica is
        dead. Each waiting request ends with the last failure seen; when no replica ever
        answered, that is the command's error instead."""
        failure = self.last_failure or next(
            (r.last_failure for r in self.replicas if r.last_failure is not None),
            Failure(ErrorCode.INTERNAL, "no replica to send the request to"),
        )
        if not any(r.worked for r in self.replicas):
            raise error_for(failure.code, failure.message)
        while self.waiting:
            self._finish(self.waiting.popleft(), failure.event())

    def _finish(self, index: int, event: Event) -> None:
        """End request ``index`` here with ``event`` (not sent, or given up on)."""
        self._settle(index)
        self.ready.append((index, event))

    def _settle(self, index: int) -> None:
        """Request ``index`` has its terminal event: let go of all that was kept for it."""
        self.open.discard(index)
        self.cancelled.discard(index)
        self.sends.pop(index, None)
        self.produced.discard(index)
        self.avoid.pop(index, None)
        self.adjusted.pop(index, None)
        self.hurried.discard(index)

    # --- the caller's controls ---------------------------------------------------------------

    def cancel(self, index: int | None = None) -> None:
        """Stop request ``index`` (None: every one); each still ends with its terminal event."""
        self._pull()  # a feed's requests not taken in yet are stopped too
        targets = sorted(self.open) if index is None else [index]
        for i in targets:
            if i not in self.open:
                continue
            if i in self.waiting:
                self.waiting.remove(i)
                self._finish(i, Event.error(ErrorCode.CANCELLED, "cancelled before it was sent"))
                continue
            serial = self.serial_of.get(i)
            if serial is None:
                continue
            self.cancelled.add(i)
            replica = self.live[serial][1]
            event = replica.cancel(serial)
            if event is not None:
                self._event(serial, event)

    def adjust(self, index: int, floor: float) -> None:
        """Set request ``index``'s ``confidence_floor``: where it runs, as far as its engine
        can; where it is sent later (again, or for the first time), with it."""
        if index not in self.open:
            return
        self.adjusted[index] = floor
        serial = self.serial_of.get(index)
        if serial is not None:
            self.live[serial][1].adjust(serial, floor)

    def answer_now(self, index: int) -> None:
        """Have request ``index`` answer now (close its thinking, as a budget reached does):
        where it runs, as far as its engine can; where it is sent later (again, or for the
        first time), at once. Once its thinking is over, nothing changes."""
        if index not in self.open or index in self.hurried:
            return
        self.hurried.add(index)
        serial = self.serial_of.get(index)
        if serial is not None:
            self.live[serial][1].answer_now(serial)

    def close(self) -> None:
        """Hang up: whatever still runs is cancelled, and no more events come."""
        if self.closed:
            return
        self.closed = True
        for replica in self.replicas:
            replica.close(idle=not replica.in_flight)

    def summary(self) -> list[JSON]:
        """Each replica's part: answered, failed, tokens and tokens/s over the flight."""
        elapsed = time.monotonic() - self.began
        return [replica.summary(elapsed) for replica in self.replicas]


class FlightStream:
    """One request's events as an iterator, ending with exactly one ``done`` or ``error``.

    An iterator object rather than a generator, so a Ctrl-C while it waits for the next event
    leaves it usable: the caller can ``cancel()`` and read on to the partial answer's end.
    """

    def __init__(self, flight: Flight) -> None:
        self._flight = flight

    def __iter__(self) -> FlightStream:
        return self

    def __next__(self) -> Event:
        try:
            _index, event = next(self._flight)
        except StopIteration:
            self._flight.close()
            raise
        if event.terminal:
            self._flight.close()
        return event

    @property
    def spawned(self) -> bool:
        """A daemon was started for this request."""
        return any(getattr(r, "spawned", False) for r in self._flight.replicas)

    def cancel(self) -> None:
        """Ask the engine to stop; the events go on to the terminal one (partial answer kept)."""
        self._flight.cancel(0)

    def answer_now(self) -> None:
        """Ask the engine to close the thinking so the model answers from what it has."""
        self._flight.answer_now(0)

    def close(self) -> None:
        """Hang up: the request is cancelled and no more events come."""
        self._flight.close()
