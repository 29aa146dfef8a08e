"""The one request path (phi4cli.backends.dispatch) with fake replicas: the window, the choice of
replica, exactly one terminal event per request, the resend rule and its bound, restarts, busy
answers, cancellation. The real daemon and real servers go through the same Flight in
test_solve_daemon, test_chat, test_remote_backend and test_replicas; here each rule is pinned down
alone."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phi4cli.backends.dispatch import DEAD, Delivery, Failure, Probe, Replica, Slow
from phi4cli.backends.flight import Flight
from phi4cli.core.errors import DaemonUnavailableError, Phi4Error
from phi4cli.core.protocol import ErrorCode, Event, EventKind

# What one attempt does: the items its replica delivers, in order.
Script = Callable[["FakeReplica", int, dict[str, Any]], list[Any]]


def answer(text: str) -> list[Any]:
    return [Event(EventKind.TOKEN, text=text), Event(EventKind.DONE)]


class FakeInbox:
    def __init__(self) -> None:
        self.queue: deque[Delivery] = deque()

    def get(self, timeout: float | None) -> Delivery | None:
        if self.queue:
            return self.queue.popleft()
        time.sleep(min(timeout or 0.0, 0.01))
        return None


class FakeReplica(Replica):
    def __init__(
        self, name: str, window: int, inbox: FakeInbox, script: Script, probe_up: bool = True
    ) -> None:
        super().__init__(window)
        self.name, self.inbox, self.script, self.probe_up = name, inbox, script, probe_up
        self.attempts: list[int] = []  # the request index of each attempt sent here
        self.peak = 0
        self.recoveries = 0
        self.cancelled: list[int] = []

    def send(self, serial: int, op: str, params: dict[str, Any]) -> None:
        self.attempts.append(params["i"])
        self.peak = max(self.peak, len(self.in_flight))
        for item in self.script(self, serial, params):
            self.inbox.queue.append((self, serial, item))

    def cancel(self, serial: int) -> Event | None:
        self.cancelled.append(serial)
        return Event.error(ErrorCode.CANCELLED, "cancelled")

    def recover(self, flight: Flight) -> None:
        self.recoveries += 1
        self.inbox.queue.append((self, None, Probe(self.probe_up, self.last_failure)))


def fly(
    n: int, replicas: list[FakeReplica], inbox: FakeInbox, restart: bool = False
) -> dict[int, list[Event]]:
    events: dict[int, list[Event]] = {i: [] for i in range(n)}
    Flight([{"i": i} for i in range(n)], list(replicas), inbox, restart=restart).run(
        lambda index, event: events[index].append(event)
    )
    return events


def terminals(events: dict[int, list[Event]]) -> dict[int, list[Event]]:
    return {i: [e for e in evs if e.terminal] for i, evs in events.items()}


def text(events: list[Event]) -> str:
    out = ""
    for event in events:
        if event.kind == EventKind.RESTART:
            out = ""
        elif event.kind == EventKind.TOKEN:
            out += event.text
    return out


def test_requests_spread_over_replicas_within_each_window():
    inbox = FakeInbox()
    replicas = [
        FakeReplica(name, 3, inbox, lambda r, s, p: answer(f"{r.name}{p['i']}")) for name in "ab"
    ]
    events = fly(12, replicas, inbox)
    assert all(len(t) == 1 and t[0].kind == EventKind.DONE for t in terminals(events).values())
    assert sorted(replicas[0].attempts + replicas[1].attempts) == list(range(12))
    assert replicas[0].attempts and replicas[1].attempts, "both replicas get work"
    assert max(r.peak for r in replicas) <= 3


def test_the_replica_with_fewest_in_flight_gets_the_next_request():
    inbox = FakeInbox()
    slow_done: list[Any] = []

    def holds(r: FakeReplica, serial: int, p: dict[str, Any]) -> list[Any]:
        slow_done.append((r, serial))  # answered later, by hand
        return [Event(EventKind.TOKEN, text="x")]

    a = FakeReplica("a", 4, inbox, holds)
    b = FakeReplica("b", 4, inbox, holds)
    flight = Flight([{"i": i} for i in range(6)], [a, b], inbox)
    next(flight)  # fills both windows' worth, fewest in flight first
    assert (len(a.attempts), len(b.attempts)) == (3, 3)


def test_work_a_replica_failed_before_any_output_goes_to_another():
    inbox = FakeInbox()

    def dies(r: FakeReplica, s: int, p: dict[str, Any]) -> list[Any]:
        return [Failure(ErrorCode.BACKEND_ERROR, "the connection broke", down=True)]

    a = FakeReplica("a", 2, inbox, dies, probe_up=False)
    b = FakeReplica("b", 2, inbox, lambda r, s, p: answer(f"b{p['i']}"))
    events = fly(6, [a, b], inbox)
    assert [text(events[i]) for i in range(6)] == [f"b{i}" for i in range(6)]
    assert a.recoveries == 1 and a.state == DEAD, "probed once, given up on"
    assert all(not any(e.kind == EventKind.RESTART for e in evs) for evs in events.values())


def test_a_request_cut_mid_answer_restarts_elsewhere_only_when_the_caller_folds():
    def cut(r: FakeReplica, s: int, p: dict[str, Any]) -> list[Any]:
        return [
            Event(EventKind.TOKEN, text="half"),
            Failure(ErrorCode.BACKEND_ERROR, "the stream was cut", down=True),
        ]

    inbox = FakeInbox()
    a = FakeReplica("a", 1, inbox, cut, probe_up=False)
    b = FakeReplica("b", 1, inbox, lambda r, s, p: answer("whole"))
    a.window = a.limit = 5  # a takes the request first
    events = fly(1, [a, b], inbox, restart=True)
    kinds = [e.kind for e in events[0]]
    assert kinds == [EventKind.TOKEN, EventKind.RESTART, EventKind.TOKEN, EventKind.DONE]
    assert text(events[0]) == "whole", "the output never holds an answer twice"

    # A stream to a screen cannot take back what it showed: the cut is its error.
    inbox = FakeInbox()
    a = FakeReplica("a", 5, inbox, cut)
    b = FakeReplica("b", 1, inbox, lambda r, s, p: answer("whole"))
    events = fly(1, [a, b], inbox, restart=False)
    assert [e.kind for e in events[0]] == [EventKind.TOKEN, EventKind.ERROR]
    assert events[0][-1].message == "the stream was cut"
    assert b.attempts == []


def test_a_request_is_sent_at_most_once_more_than_there_are_replicas():
    inbox = FakeInbox()

    def worked_then_dies(r: FakeReplica, s: int, p: dict[str, Any]) -> list[Any]:
        r.worked = True  # it had answered before: worth recovering
        return [Failure(ErrorCode.UNREACHABLE, f"{r.name} went away", down=True)]

    replicas = [FakeReplica(name, 2, inbox, worked_then_dies) for name in "ab"]
    events = fly(3, replicas, inbox)
    for i in range(3):
        sends = replicas[0].attempts.count(i) + replicas[1].attempts.count(i)
        assert sends == 3, "1 + 2 replicas"
        assert [e.kind for e in events[i]] == [EventKind.ERROR]
        assert events[i][0].code == ErrorCode.UNREACHABLE


def test_nothing_reachable_at_all_is_the_commands_error_not_n_records():
    inbox = FakeInbox()

    def refused(r: FakeReplica, s: int, p: dict[str, Any]) -> list[Any]:
        return [Failure(ErrorCode.UNREACHABLE, "cannot reach the backend", down=True)]

    class Remote(FakeReplica):
        def may_recover(self, failure: Failure) -> bool:  # as RemoteReplica's rule
            return self.worked or failure.code != ErrorCode.UNREACHABLE

    replicas = [Remote(name, 4, inbox, refused, probe_up=False) for name in "ab"]
    with pytest.raises(DaemonUnavailableError, match="cannot reach the backend"):
        fly(8, replicas, inbox)


def test_busy_is_sent_again_later_with_a_smaller_window_and_is_not_an_attempt():
    inbox = FakeInbox()
    refusals = {0: 3}

    def busy_first(r: FakeReplica, s: int, p: dict[str, Any]) -> list[Any]:
        if refusals.get(p["i"], 0):
            refusals[p["i"]] -= 1
            return [Slow(0.01, requeue=True)]
        return answer(f"ok{p['i']}")

    a = FakeReplica("a", 4, inbox, busy_first)
    events = fly(4, [a], inbox)
    assert [text(events[i]) for i in range(4)] == ["ok0", "ok1", "ok2", "ok3"]
    assert a.attempts.count(0) == 4, "three refusals, then the answer: refusals do not count"


def test_a_slow_note_pauses_new_work_on_that_replica():
    inbox = FakeInbox()
    a = FakeReplica("a", 8, inbox, lambda r, s, p: answer("x"))
    flight = Flight([{"i": i} for i in range(3)], [a], inbox)
    flight._take(a, None, Slow(0.3))
    assert a.room(time.monotonic()) == 0
    started = time.monotonic()
    assert len([e for _i, e in flight if e.terminal]) == 3
    assert time.monotonic() - started >= 0.25


def test_cancel_ends_waiting_requests_at_once_and_live_ones_through_their_replica():
    inbox = FakeInbox()
    a = FakeReplica("a", 1, inbox, lambda r, s, p: [Event(EventKind.TOKEN, text="x")])
    flight = Flight([{"i": i} for i in range(3)], [a], inbox)
    first = next(flight)
    assert first[1].kind == EventKind.TOKEN
    flight.cancel()
    rest = list(flight)
    ends = {i: e for i, e in rest if e.terminal}
    assert set(ends) == {0, 1, 2}
    assert all(e.code == ErrorCode.CANCELLED for e in ends.values())
    assert ends[1].message == "cancelled before it was sent"
    assert a.cancelled and a.attempts == [0]


OUTCOMES = st.sampled_from(["done", "token-done", "busy", "down", "token-down", "draining"])


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 12),
    windows=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    plan=st.lists(OUTCOMES, min_size=1, max_size=40),
    restart=st.booleans(),
    probe_up=st.booleans(),
)
def test_every_request_ends_exactly_once_whatever_the_replicas_do(
    n: int, windows: list[int], plan: list[str], restart: bool, probe_up: bool
):
    inbox = FakeInbox()
    steps = iter(plan)
    busy_left = [20]  # busy answers are not attempts: bound them so the run ends
    refused: list[int] = []

    def script(r: FakeReplica, s: int, p: dict[str, Any]) -> list[Any]:
        outcome = next(steps, "done")
        if outcome == "busy":
            busy_left[0] -= 1
            outcome = "busy" if busy_left[0] > 0 else "done"
            if outcome == "busy":
                refused.append(p["i"])
        token = [Event(EventKind.TOKEN, text=f"{r.name}{p['i']}")]
        return {
            "done": answer(f"{r.name}{p['i']}"),
            "token-done": [*token, Event(EventKind.DONE)],
            "busy": [Slow(0.0, requeue=True)],
            "down": [Failure(ErrorCode.BACKEND_ERROR, "broke", down=True)],
            "token-down": [*token, Failure(ErrorCode.BACKEND_ERROR, "cut", down=True)],
            "draining": [Failure(ErrorCode.SHUTTING_DOWN, "stopping", draining=True)],
        }[outcome]

    replicas = [FakeReplica(f"r{k}", w, inbox, script, probe_up) for k, w in enumerate(windows)]
    try:
        events = fly(n, replicas, inbox, restart=restart)
    except Phi4Error:  # no replica ever answered: the failure is the command's
        assert not any(r.worked for r in replicas)
        return
    for i in range(n):
        ends = [e for e in events[i] if e.terminal]
        assert len(ends) == 1, (i, events[i])
        assert events[i][-1].terminal, "nothing after the terminal event"
        sent = sum(r.attempts.count(i) for r in replicas)
        assert sent or all(r.state == DEAD for r in replicas), "unsent only when none is left"
        assert sent - refused.count(i) <= len(replicas) + 1, "busy refusals do not count"
        if not restart:
            assert all(e.kind != EventKind.RESTART for e in events[i])
        if ends[0].kind == EventKind.DONE:
            shown = text(events[i])
            assert shown.endswith(str(i)) and len(shown) == len(f"r0{i}"), "one answer, once"
    for replica in replicas:
        assert replica.peak <= replica.limit


def test_the_failure_of_an_attempt_already_cancelled_says_nothing_of_its_replica():
    # Before: a hang-up of our own, reported late as the server's failure, marked it down.
    inbox = FakeInbox()
    a = FakeReplica("a", 2, inbox, lambda r, s, p: [Event(EventKind.TOKEN, text="x")])
    flight = Flight([{"i": i} for i in range(3)], [a], inbox)
    assert next(flight)[1].kind == EventKind.TOKEN
    flight.cancel(0)
    inbox.queue.append((a, 1, Failure(ErrorCode.BACKEND_ERROR, "the connection broke", down=True)))
    ends = {}
    for index, event in flight:
        if event.terminal:
            ends[index] = event
        if index != 0 and event.kind == EventKind.TOKEN:
            flight.cancel(index)
    assert a.state == "up" and a.recoveries == 0
    assert ends[0].code == ErrorCode.CANCELLED and set(ends) == {0, 1, 2}


def test_a_request_interrupted_while_it_is_sent_is_waiting_again_not_cancelled_twice():
    inbox = FakeInbox()

    class Interrupted(FakeReplica):
        def send(self, serial: int, op: str, params: dict[str, Any]) -> None:
            if not self.attempts:
                self.attempts.append(-1)
                raise KeyboardInterrupt  # the daemon was starting
            super().send(serial, op, params)

    a = Interrupted("a", 1, inbox, lambda r, s, p: answer("ok"))
    flight = Flight([{"i": 0}], [a], inbox)
    with pytest.raises(KeyboardInterrupt):
        next(flight)
    flight.cancel(0)
    events = list(flight)
    assert [e.kind for _i, e in events] == [EventKind.ERROR]
    assert events[0][1].message == "cancelled before it was sent"


class GrowingFeed:
    """Requests that come in over time, as lines of a pipe do: one more each time the flight
    waits for them, until ``total``."""

    def __init__(self, requests: list[Any], total: int) -> None:
        self.requests, self.total = requests, total
        self.ended = False
        self.waits = 0

    def wait(self, timeout: float) -> None:
        self.waits += 1
        self.add()

    def add(self) -> None:
        if len(self.requests) < self.total:
            i = len(self.requests)
            self.requests.append(
                Event.error(ErrorCode.BAD_REQUEST, f"line {i} is bad") if i == 3 else {"i": i}
            )
        self.ended = len(self.requests) >= self.total


def test_a_feed_adds_requests_as_they_come_and_the_flight_ends_with_it():
    inbox = FakeInbox()
    a = FakeReplica("a", 4, inbox, lambda r, s, p: answer(str(p["i"])))
    requests: list[Any] = []
    feed = GrowingFeed(requests, 6)
    events: dict[int, list[Event]] = {}
    Flight(requests, [a], inbox, feed=feed).run(
        lambda index, event: events.setdefault(index, []).append(event)
    )
    assert sorted(events) == list(range(6))
    assert all(len(t) == 1 for t in terminals(events).values())
    assert [text(events[i]) for i in (0, 1, 2, 4, 5)] == ["0", "1", "2", "4", "5"]
    # A request that is an error event is not sent: it ends with that error.
    assert events[3] == [Event.error(ErrorCode.BAD_REQUEST, "line 3 is bad")]
    assert 3 not in a.attempts and feed.waits >= 6


def test_a_feed_that_ends_with_nothing_sends_nothing():
    inbox = FakeInbox()
    a = FakeReplica("a", 4, inbox, lambda r, s, p: answer("x"))
    feed = GrowingFeed([], 0)
    Flight([], [a], inbox, feed=feed).run(lambda index, event: None)
    assert a.attempts == [] and feed.waits == 1


def test_a_finished_flight_keeps_nothing_per_request():
    # A run of a million keeps a window's worth: each request's bookkeeping goes when it ends.
    inbox = FakeInbox()
    a = FakeReplica("a", 4, inbox, lambda r, s, p: answer(str(p["i"])))
    flight = Flight([{"i": i} for i in range(50)], [a], inbox, restart=True)
    flight.run(lambda index, event: None)
    assert (flight.open, flight.sends, flight.produced, flight.avoid, flight.live) == (
        set(),
        {},
        set(),
        {},
        {},
    )


def test_requests_that_come_as_the_feed_ends_are_sent_not_given_up_on():
    # Before: the last lines, taken in by the step's own look at the feed just as it ended,
    # fell through to "no replica to send the request to".
    inbox = FakeInbox()
    answered: list[int] = []
    a = FakeReplica("a", 4, inbox, lambda r, s, p: answer(str(p["i"])))
    requests: list[Any] = [{"i": 0}]

    class EndingFeed:
        reads_after_first = 0

        @property
        def ended(self) -> bool:
            if not answered:
                return False
            self.reads_after_first += 1
            if self.reads_after_first == 2:  # the step's own read, not __next__'s
                requests.append({"i": 1})
            return self.reads_after_first >= 2

        def wait(self, timeout: float) -> None:
            pass

    events: dict[int, list[Event]] = {}

    def on_event(index: int, event: Event) -> None:
        events.setdefault(index, []).append(event)
        if event.terminal:
            answered.append(index)

    Flight(requests, [a], inbox, feed=EndingFeed()).run(on_event)
    assert [text(events[i]) for i in (0, 1)] == ["0", "1"]
    assert all(len(t) == 1 and t[0].kind == EventKind.DONE for t in terminals(events).values())


@pytest.mark.timeout(60)  # resent, it would stream forever
def test_a_cancelled_request_whose_engine_fails_before_confirming_is_not_sent_again():
    # Before: the daemon's cancel is confirmed by its terminal event; a daemon that went away
    # first made it a failure like any other, and the request was resent to a fresh daemon.
    inbox = FakeInbox()

    class LateCancel(FakeReplica):
        def cancel(self, serial: int) -> Event | None:
            self.cancelled.append(serial)
            return None  # confirmed later, as the daemon does

    def script(r: FakeReplica, s: int, p: dict[str, Any]) -> list[Any]:
        return [Event(EventKind.TOKEN, text="x")] if p["i"] == 0 else answer("y")

    a = LateCancel("a", 3, inbox, script)
    flight = Flight([{"i": i} for i in range(3)], [a], inbox, restart=True)
    assert next(flight) == (0, Event(EventKind.TOKEN, text="x"))
    flight.cancel(0)
    inbox.queue.appendleft(
        (a, 1, Failure(ErrorCode.BACKEND_ERROR, "the daemon went away", down=True))
    )
    ends: dict[int, Event] = {}
    kinds: list[EventKind] = []
    for index, event in flight:
        if index == 0:
            kinds.append(event.kind)
        if event.terminal:
            ends[index] = event
    assert set(ends) == {0, 1, 2} and ends[0].code == ErrorCode.CANCELLED
    assert a.attempts.count(0) == 1, "not sent again"
    assert EventKind.RESTART not in kinds
