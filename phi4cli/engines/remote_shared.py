"""Samples of one question asked together: one request with ``n`` whose choices are the samples'
first legs (see SharedRequest). A replica makes one of the samples a flight gives it in one
round; each sample's stream reads its choice through a SharedMember."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from phi4cli.core.errors import DaemonUnavailableError
from phi4cli.core.protocol import ErrorCode, SolveParams
from phi4cli.engines.remote import (
    Attempt,
    RemoteEngine,
    StreamState,
    messages_for,
    wants_confidence,
)
from phi4cli.engines.remote_wire import AskAlone, StreamFailure, Watch, choices_of, response_chunks
from phi4cli.text.confidence import TraceConfidence

MAX_SHARED = 16  # samples of a question asked in one request (its n), at most


class SharedRequest:
    """Samples of one question asked as one request with ``n`` (vLLM, SGLang, phi4 serve and
    the llama-server builds that take it decode the choices together, the prompt's work done
    once). One thread reads the stream and hands each choice's chunks to its sample's reader,
    which treats them as its own response; the request is hung up once no sample reads it (an
    early stop cancels them all). A sample that leaves early (a loop, a think budget, DeepConf's
    floor) is no longer handed its chunks, though the server goes on with its choice: one
    choice of a request cannot be stopped alone. What comes after its first leg (an answer
    asked for after a budget, a "Wait") it asks on its own."""

    def __init__(self, engine: RemoteEngine, params: SolveParams, count: int) -> None:
        import queue

        self.engine, self.params, self.count = engine, params, count
        self.queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(count)]
        self.heard = [False] * count  # a chunk of this choice came
        self.reading = count  # members still reading
        self._lock = threading.Lock()
        self.state = StreamState(time.monotonic())
        if wants_confidence(params):
            self.state.trace = TraceConfidence()  # (the stream's size limit allows logprobs)
        self.attempt = Attempt()  # to hang up once nobody reads
        self.state.attempt = self.attempt

    def member(self, index: int) -> SharedMember:
        return SharedMember(self, index)

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True, name="phi4-remote-n").start()

    def leave(self) -> None:
        with self._lock:
            self.reading -= 1
            last = self.reading == 0
        if last:
            self.attempt.cancel()  # hangs up the shared connection

    def _read(self) -> None:
        engine = self.engine
        body = engine.request_body(self.params, messages_for(self.params))
        body["n"] = self.count
        ended: tuple[str, Exception | None] = ("end", None)
        # A choice's last chunk waits here while nothing else comes: the usage, which a server
        # sends after the last choice ends, is then its sample's too. A chunk of another
        # choice says the stream goes on, and lets it go at once.
        held: list[tuple[int, dict[str, Any]]] = []
        finished: set[int] = set()

        def release() -> None:
            for index, chunk in held:
                self.queues[index].put(chunk)
            held.clear()

        try:
            with Watch(engine, self.state) as watch:
                for chunk in response_chunks(engine, engine.http_client(), body, watch):
                    if self.attempt.cancelled or chunk is None:
                        break
                    usage = chunk.get("usage")
                    if isinstance(usage, dict):
                        # The prompt's numbers are each sample's; the completions' are summed
                        # over the choices, so each sample counts its own.
                        prompt = {k: usage[k] for k in ("prompt_tokens", "prompt_tokens_details")
                                  if k in usage}  # fmt: skip
                        for each in self.queues:
                            each.put({"usage": prompt})
                        release()
                    for choice in choices_of(chunk, engine.url):
                        index = choice.get("index", 0)
                        if not (isinstance(index, int) and not isinstance(index, bool)
                                and 0 <= index < self.count):  # fmt: skip
                            continue
                        self.heard[index] = True
                        if choice.get("finish_reason"):
                            held.append((index, {"choices": [choice]}))
                            finished.add(index)
                            # Every choice whole: a server that then hangs up without [DONE]
                            # loses only its usage.
                            watch.finished = len(finished) == self.count
                        else:
                            release()
                            self.queues[index].put({"choices": [choice]})
            release()
        except StreamFailure as failure:
            if failure.code == ErrorCode.BAD_REQUEST:  # (n refused, say): each asks alone
                engine.takes_n = False
                ended = ("alone", None)
            else:
                ended = ("fail", failure)
        except DaemonUnavailableError as error:
            ended = ("fail", error)
        except Exception as error:  # a bug here must not leave the samples waiting
            ended = (
                "fail",
                StreamFailure(
                    ErrorCode.INTERNAL, f"reading the backend {engine.url} failed: {error!r}"
                ),
            )
        if ended[0] == "end" and not self.attempt.cancelled:
            if all(self.heard):
                engine.takes_n = True
            elif self.heard[0] and not any(self.heard[1:]):
                engine.takes_n = False  # it answered one choice: n is not what it reads
        for index, each in enumerate(self.queues):
            alone = ended[0] == "end" and not self.heard[index] and not self.attempt.cancelled
            each.put(("alone", None) if alone else ended)


class SharedMember:
    """One sample's view of a shared request: its choice's chunks, then None at the end."""

    def __init__(self, shared: SharedRequest, index: int) -> None:
        self.shared, self.index = shared, index

    def chunks(self, state: StreamState) -> Iterator[dict[str, Any] | None]:
        inbox = self.shared.queues[self.index]
        attempt = state.attempt
        try:
            if attempt is not None:
                attempt.wake = lambda: inbox.put(("cancelled", None))  # the flight ended it
                if attempt.cancelled:  # (before it could be woken)
                    return
            while True:
                item = inbox.get()
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
            self.shared.leave()


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
