"""Samples of one question asked together: one request with ``n`` whose choices are the samples'
first legs (see SharedRequest). A replica makes one of the samples a flight gives it in one
round; each sample's stream reads its choice through a SharedMember.

What a shared request holds is bounded by what its live samples still read, whatever the server
sends. A sample that leaves its choice (its ``-n`` spent, a loop caught, a think budget, DeepConf's
floor, a cancel) drops what its choice holds at once, and every later chunk of that choice is
dropped as it is read; the server is told nothing (one choice of a request cannot be stopped
alone), and once every sample has left the request is hung up. A live sample's choice holds at most
CHOICE_QUEUE_CHARS unread, and one event more (of up to 1 MiB): the events' data, each counted
CHUNK_OVERHEAD more for what it is parsed into. Past that the reader waits, and reads nothing from
the socket meanwhile, so a server that writes faster than a sample reads is held back by TCP rather
than buffered here. That wait cannot deadlock: it is only on a live sample, whose thread takes its
chunks waiting on nothing else (it hands its events to the flight's inbox, which does not wait, and
never to another choice), so it drains its queue or leaves, and either wakes the reader; a sample
that will not read its choice at all (no thinking asked, a stream that ended before its first leg)
leaves when it knows, and its replica thread leaves for it at the latest. The other live choices
wait meanwhile, as their chunks wait behind in the one stream anyway: a shared request goes at its
slowest live sample's pace. The request's deadline is still kept while the reader waits."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from phi4cli.backends.remote import (
    Attempt,
    RemoteServer,
    StreamState,
    messages_for,
    wants_confidence,
)
from phi4cli.backends.remote_wire import AskAlone, StreamFailure, Watch, choices_of, response_chunks
from phi4cli.core.errors import DaemonUnavailableError
from phi4cli.core.protocol import ErrorCode, SolveParams
from phi4cli.text.confidence import TraceConfidence

MAX_SHARED = 16  # samples of a question asked in one request (its n), at most
CHOICE_QUEUE_CHARS = 256 * 1024  # a live choice's unread chunks, at most, before the reader waits
CHUNK_OVERHEAD = 512  # counted for each chunk beside its data: the objects it is parsed into
ROOM_POLL_S = 0.5  # how often a reader waiting for room looks at the request's deadline


class SharedRequest:
    """Samples of one question asked as one request with ``n`` (vLLM, SGLang, phi4 serve and
    the llama-server builds that take it decode the choices together, the prompt's work done
    once). One thread reads the stream and hands each choice's chunks to its sample's reader,
    which treats them as its own response; the request is hung up once no sample reads it (an
    early stop cancels them all). A sample that leaves early (a loop, a think budget, DeepConf's
    floor) is no longer handed its chunks, and what it was handed is dropped, though the server
    goes on with its choice: one choice of a request cannot be stopped alone. What comes after
    its first leg (an answer asked for after a budget, a "Wait") it asks on its own. What the
    request may hold: see the module's docstring."""

    def __init__(self, server: RemoteServer, params: SolveParams, count: int) -> None:
        self.server, self.params, self.count = server, params, count
        # Each choice's chunks not yet read, with the weight each counts (see _post).
        self.inboxes: list[deque[tuple[Any, int]]] = [deque() for _ in range(count)]
        self.queued = [0] * count  # the weight each choice holds unread
        self.left = [False] * count  # its sample reads no more of it
        self.heard = [False] * count  # a chunk of this choice came
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # the reader waits here for room
        self._ready = [threading.Condition(self._lock) for _ in range(count)]  # each sample
        self.state = StreamState(time.monotonic())
        if wants_confidence(params):
            self.state.trace = TraceConfidence()  # (the stream's size limit allows logprobs)
        self.attempt = Attempt()  # to hang up once nobody reads
        self.state.attempt = self.attempt

    def member(self, index: int) -> SharedMember:
        return SharedMember(self, index)

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True, name="phi4-remote-n").start()

    def leave(self, index: int) -> None:
        """Choice ``index``'s sample reads no more of it: what it holds is dropped, and so is
        what comes for it; the last to leave hangs the request up. Leaving again does nothing."""
        with self._lock:
            if self.left[index]:
                return
            self.left[index] = True
            self.inboxes[index].clear()
            self.queued[index] = 0
            self._room.notify()  # the reader may be waiting for room in it
            last = all(self.left)
        if last:
            self.attempt.cancel()  # hangs up the shared connection

    def wake(self, index: int) -> None:
        """The flight cancelled choice ``index``'s sample: its reader, waiting for a chunk,
        stops."""
        self._post(index, ("cancelled", None))

    def take(self, index: int) -> Any:
        """Choice ``index``'s next chunk (or end), waiting for it."""
        with self._lock:
            inbox = self.inboxes[index]
            while not inbox:
                self._ready[index].wait()
            item, weight = inbox.popleft()
            self.queued[index] -= weight
            if weight:
                self._room.notify()
            return item

    def _post(self, index: int, item: Any, weight: int = 0, watch: Watch | None = None) -> None:
        """Hand ``item`` to choice ``index``'s sample, or drop it when the sample has left.
        With ``watch`` (a chunk read from the stream, counted ``weight``), first wait while the
        choice holds CHOICE_QUEUE_CHARS unread; an end or a wake-up is handed at once."""
        with self._lock:
            waited = False
            while (
                watch is not None
                and self.queued[index] >= CHOICE_QUEUE_CHARS
                and not self.left[index]
                and not self.attempt.cancelled
            ):
                waited = True
                self._room.wait(ROOM_POLL_S)
                if time.monotonic() - watch.started > watch.deadline:
                    raise watch.too_long()
            if waited and watch is not None:
                watch.last_event = time.monotonic()  # the wait was this side's, not silence
            if self.left[index]:
                return
            self.inboxes[index].append((item, weight))
            self.queued[index] += weight
            self._ready[index].notify()

    def _read(self) -> None:
        if self.attempt.cancelled:
            return  # every sample left before it was asked (none thinks, say): nothing to ask
        server = self.server
        body = server.request_body(self.params, messages_for(self.params))
        body["n"] = self.count
        ended: tuple[str, Exception | None] = ("end", None)
        # A choice's last chunk waits here while nothing else comes: the usage, which a server
        # sends after the last choice ends, is then its sample's too. A chunk of another
        # choice says the stream goes on, and lets it go at once.
        held: list[tuple[int, dict[str, Any], int]] = []
        finished: set[int] = set()

        def release(watch: Watch) -> None:
            for index, chunk, weight in held:
                self._post(index, chunk, weight, watch)
            held.clear()

        try:
            with Watch(server, self.state) as watch:
                for chunk in response_chunks(server, server.http_client(), body, watch):
                    if self.attempt.cancelled or chunk is None:
                        break
                    # Each choice's share counts the whole event: what one holds is bounded
                    # by what it was sent, however the event splits.
                    weight = watch.event_size + CHUNK_OVERHEAD
                    usage = chunk.get("usage")
                    if isinstance(usage, dict):
                        # The prompt's numbers are each sample's; the completions' are summed
                        # over the choices, so each sample counts its own.
                        prompt = {
                            k: usage[k]
                            for k in ("prompt_tokens", "prompt_tokens_details")
                            if k in usage
                        }
                        for index in range(self.count):
                            self._post(index, {"usage": prompt}, weight, watch)
                        release(watch)
                    for choice in choices_of(chunk, server.url):
                        index = choice.get("index", 0)
                        if not (
                            isinstance(index, int)
                            and not isinstance(index, bool)
                            and 0 <= index < self.count
                        ):
                            continue
                        self.heard[index] = True
                        if index in finished:
                            continue  # its sample ends at its finish: nothing after is read
                        if choice.get("finish_reason"):
                            held.append((index, {"choices": [choice]}, weight))
                            finished.add(index)
                            # Every choice whole: a server that then hangs up without [DONE]
                            # loses only its usage.
                            watch.finished = len(finished) == self.count
                        else:
                            release(watch)
                            self._post(index, {"choices": [choice]}, weight, watch)
                release(watch)
        except StreamFailure as failure:
            if failure.code == ErrorCode.BAD_REQUEST:  # (n refused, say): each asks alone
                server.takes_n = False
                ended = ("alone", None)
            else:
                ended = ("fail", failure)
        except DaemonUnavailableError as error:
            ended = ("fail", error)
        except Exception as error:  # a bug here must not leave the samples waiting
            ended = (
                "fail",
                StreamFailure(
                    ErrorCode.INTERNAL, f"reading the backend {server.url} failed: {error!r}"
                ),
            )
        if ended[0] == "end" and not self.attempt.cancelled:
            if all(self.heard):
                server.takes_n = True
            elif self.heard[0] and not any(self.heard[1:]):
                server.takes_n = False  # it answered one choice: n is not what it reads
        for index in range(self.count):
            alone = ended[0] == "end" and not self.heard[index] and not self.attempt.cancelled
            self._post(index, ("alone", None) if alone else ended)


class SharedMember:
    """One sample's view of a shared request: its choice's chunks, then None at the end."""

    def __init__(self, shared: SharedRequest, index: int) -> None:
        self.shared, self.index = shared, index

    def chunks(self, state: StreamState) -> Iterator[dict[str, Any] | None]:
        shared, index = self.shared, self.index
        attempt = state.attempt
        try:
            if attempt is not None:
                attempt.wake = lambda: shared.wake(index)  # the flight ended it
                if attempt.cancelled:  # (before it could be woken)
                    return
            while True:
                item = shared.take(index)
                if isinstance(item, tuple):
                    kind, error = item
                    if kind == "cancelled":
                        return
                    if kind == "alone":
                        raise AskAlone
                    if error is not None:
                        raise error
                    yield None
                    return
                yield item
                if any(choice.get("finish_reason") for choice in item.get("choices", ())):
                    # Its choice is whole: it ends now, not when the others do (the usage,
                    # which comes after them all, is then not its to count).
                    yield None
                    return
        finally:
            self.leave()

    def leave(self) -> None:
        """Its sample reads no more of its choice (see SharedRequest.leave)."""
        self.shared.leave(self.index)


def shared_params(members: list[SolveParams]) -> SolveParams | None:
    """The one request that asks for ``members`` together, or None when they cannot be: each
    the same but for its seed, and the seeds none or consecutive (seed, seed + 1, ...: the
    choices phi4 serve gives a request seeded ``seed``), as ``--samples`` makes them."""
    first = members[0]
    bare = [m._replace(ask=m.ask._replace(seed=None)) for m in members]
    if any(b != bare[0] for b in bare[1:]):
        return None
    seeds = [m.ask.seed for m in members]
    if all(seed is None for seed in seeds):
        return first
    start = seeds[0]
    if isinstance(start, int) and seeds == list(range(start, start + len(seeds))):
        return first
    return None
