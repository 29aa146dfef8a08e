"""Remote servers: `--backend URL` sends `phi4 solve` and `phi4 chat` to any OpenAI-compatible
server (llama.cpp's llama-server, vLLM, Ollama, llama-cpp-python's server, another `phi4 serve`)
instead of the local daemon, producing the same events, so output, reasoning handling and exit
codes match.

Built on httpx2 (the maintained httpx line that huggingface_hub and openai already bring in) and its
server-sent-events reader, so nothing here parses HTTP or SSE by hand. Servers differ in how they
send thinking, and each stream is read as it comes:

- in its own field, ``reasoning_content`` (llama-server, vLLM) or ``reasoning`` (newer vLLM,
  Ollama): then ``content`` is the answer;
- inline in ``content`` between ``<think>`` and ``</think>`` (or, for a reasoning model that omits
  the opening tag, up to ``</think>``).

``--think-budget`` is enforced here, because these servers have no such option: at the budget the
stream is closed and the server is asked again with the thinking so far closed by ``</think>`` as
the start of the assistant's reply, so the model goes on with its answer.

A server is not trusted to behave: everything it sends is bounded and checked on this side
(``remote_wire.py``). An error body is read up to 64 KiB and shown as a one-line excerpt; a
stream is cut at the request's ``max_tokens`` (a length stop, whatever the server does with the
option), at 64 MiB in all and at 1 MiB an event; ``backend_timeout`` bounds the silence between
events and ``backend_deadline`` the whole request; every field read from its JSON is
type-checked. 429 and 503 are retried a few times, after the server's ``Retry-After`` when it
gives one.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import suppress
from typing import Any, Protocol

import httpx2 as httpx

from phi4cli.backends.dispatch import Announce
from phi4cli.backends.remote_wire import (
    AskAlone,
    StreamFailure,
    Watch,
    choices_of,
    count_of,
    delta_of,
    nonsense,
    response_chunks,
    seconds_of,
)
from phi4cli.core.errors import DaemonUnavailableError
from phi4cli.core.protocol import ErrorCode, Event, EventKind, SolveParams, Stats
from phi4cli.text.confidence import TOP_K, TraceConfidence, from_logprobs
from phi4cli.text.reasoning import THINK_CLOSE, THINK_OPEN, ThinkSplitter, model_thinks
from phi4cli.text.thinking import Act, ThinkingPolicy

# What a server that does not continue an assistant's message is asked once phi4 has closed the
# thinking (a budget, a loop, the answer asked for now): the thinking so far is its turn, then
# this one.
FINAL_ANSWER_ASK = "Stop thinking now. Give your final answer, with the final result in \\boxed{}."
CONNECT_TIMEOUT_S = 10.0  # at most; a shorter backend_timeout shortens it too
# Pieces of text one request may stream when it sets no max_tokens: beyond any context these
# servers run, so only an endless stream meets it.
DEFAULT_TOKEN_LIMIT = 131072
LONGEST_WAIT_S = 1e8  # about three years: longer settings are taken as this


class ChunkSource(Protocol):
    """Where a request's first leg reads its chunks when it is not its own HTTP response: one
    choice of a request shared with other samples (``remote_shared.SharedMember``); None at
    the end, AskAlone when the shared request did not carry it."""

    def chunks(self, state: StreamState) -> Iterator[dict[str, Any] | None]: ...

    def leave(self) -> None:
        """Its sample reads no more of it (closing ``chunks`` leaves too; leaving twice is once)."""


def backend_key() -> str | None:
    """The API key for the remote backend, from PHI4_BACKEND_KEY."""
    from phi4cli.core.config import variable

    return variable("PHI4_BACKEND_KEY")


def messages_for(params: SolveParams) -> list[dict[str, str]]:
    system = params.ask.system
    messages = [{"role": "system", "content": system}] if system else []
    messages += params.history
    messages.append({"role": "user", "content": params.prompt})
    return messages


class ReplicaFault(Exception):
    """An attempt the server failed (see ``StreamFailure.fault``): for the flight to send again."""

    def __init__(
        self, code: ErrorCode, message: str, down: bool, elsewhere: bool, stats: Event | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.down, self.elsewhere = code, message, down, elsewhere
        self.stats = stats  # what the attempt cost, for its error record if it stays the end


class Attempt:
    """One request's hold on its HTTP stream, for the flight's thread: cancel it (hang up), and
    hear when the server answers busy."""

    def __init__(self, on_busy: Callable[[float], None] | None = None) -> None:
        self.cancelled = False
        self.on_busy = on_busy
        self.state: StreamState | None = None
        # --stop-unsure: the stream is cut once its confidence falls below this (the request's
        # confidence_floor, or the flight's adjust since).
        self.floor: float | None = None
        # The answer is asked for now (the flight's answer_now): read by its stream's thread at
        # the next chunk, which closes the thinking as a budget reached does.
        self.answer_now = False
        # What else wakes its reader when it is cancelled: a sample reading its choice of a
        # shared request waits on a queue, not on a socket of its own.
        self.wake: Callable[[], None] | None = None

    def cancel(self) -> None:
        self.cancelled = True
        connection = self.state.socket if self.state is not None else None
        if connection is not None:
            with suppress(OSError):  # wakes the read blocked on it
                connection.shutdown(socket.SHUT_RDWR)
        if self.wake is not None:
            self.wake()


class _Reader:
    """Turns one server's deltas into reasoning and answer pieces, whichever way it sends them."""

    def __init__(self, thinks: bool) -> None:
        self.separate: bool | None = None  # None until the stream shows which way it goes
        self.inline = ThinkSplitter(starts_in_reasoning=thinks)
        self.after_thinking = ThinkSplitter(starts_in_reasoning=False)
        self.reasoning_pieces = 0
        self.answer_pieces = 0

    @property
    def splitter(self) -> ThinkSplitter:
        return self.after_thinking if self.separate else self.inline

    @property
    def in_reasoning(self) -> bool:
        if self.separate:
            return not self.answer_pieces
        return self.inline.in_reasoning

    def feed(self, delta: dict[str, Any]) -> list[tuple[EventKind, str]]:
        pieces: list[tuple[EventKind, str]] = []
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            if self.separate is None:
                self.separate = True
            pieces.append((EventKind.REASONING, reasoning))
        content = delta.get("content")
        if isinstance(content, str) and content:
            if self.separate is None:
                self.separate = False
            pieces += _kinds(self.splitter.feed(content))
        for kind, _text in pieces:
            if kind == EventKind.REASONING:
                self.reasoning_pieces += 1
            elif kind == EventKind.TOKEN:
                self.answer_pieces += 1
        return pieces

    def finish(self) -> list[tuple[EventKind, str]]:
        return _kinds(self.splitter.finish())

    def rethink(self) -> None:
        """The answer begun is not taken (--min-think): what comes next is thinking again."""
        self.separate = None
        self.inline = ThinkSplitter(starts_in_reasoning=True)
        self.after_thinking = ThinkSplitter(starts_in_reasoning=False)
        self.answer_pieces = 0

    @property
    def unfinished(self) -> bool:
        if self.separate:
            return not self.answer_pieces
        return self.inline.unfinished


def _kinds(pieces: list[tuple[str, str]]) -> list[tuple[EventKind, str]]:
    names = {
        "answer": EventKind.TOKEN,
        "reasoning": EventKind.REASONING,
        "retract": EventKind.RETRACT,
    }
    return [(names[kind], text) for kind, text in pieces]


class RemoteServer:
    """One OpenAI-compatible server, with the model name it serves."""

    def __init__(
        self,
        url: str,
        model: str,
        api_key: str | None = None,
        timeout: float = 300.0,
        deadline: float = 3600.0,
        notice: Announce | None = None,
        connections: int = 16,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.api_key = api_key
        # Seconds the server may send no event, and one request may take in all (retries
        # included); beyond LONGEST_WAIT_S a socket timeout no longer fits the platform's clock.
        self.timeout = min(timeout, LONGEST_WAIT_S)
        self.deadline = min(deadline, LONGEST_WAIT_S)
        self.notice = notice  # one line for the user, e.g. that a busy server is waited for
        self.thinks = model_thinks(model)
        self.retry_told = False  # a busy server's wait said (once per command)
        self.gives_logprobs = True  # until it refuses them: then it is not asked again
        # Whether it answers a request with ``n`` choices (None: not known yet). Found out by
        # the first samples asked together, and remembered: one that refuses n, or answers
        # one choice, is sent each sample on its own from then on.
        self.takes_n: bool | None = None
        # Whether it continues an assistant's message it is sent (llama-server, vLLM asked to);
        # one that refuses to (phi4 serve) is asked afresh for an answer from then on.
        self.continues = True
        self.connections = max(1, connections)  # kept open to the server, for the requests at once
        self._client: httpx.Client | None = None
        self._client_lock = threading.Lock()

    def http_client(self) -> httpx.Client:
        """The server's one HTTP client: its connection pool is shared by every request in
        flight (httpx's pool is thread-safe), so a run of thousands opens few connections."""
        with self._client_lock:
            if self._client is None:
                # No compression: a small compressed body must not become a huge one in memory.
                headers = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}
                if self.api_key:
                    headers["Authorization"] = f"Bearer {self.api_key}"
                timeout = httpx.Timeout(self.timeout, connect=min(CONNECT_TIMEOUT_S, self.timeout))
                limits = httpx.Limits(
                    max_connections=self.connections + 4, max_keepalive_connections=self.connections
                )
                self._client = httpx.Client(timeout=timeout, headers=headers, limits=limits)
            return self._client

    def close(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    @property
    def root(self) -> str:
        """The server's address without its ``/v1``: where ``/health`` is."""
        return self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url

    @property
    def v1(self) -> str:
        """The server's address with its ``/v1``: where the OpenAI routes are."""
        return self.url if self.url.endswith("/v1") else self.url + "/v1"

    @property
    def endpoint(self) -> str:
        return self.v1 + "/chat/completions"

    def side_client(self, timeout: float) -> httpx.Client:
        """A client for one short look beside the answers (a health probe, the metrics page):
        the key, no compression (a small body must not become a huge one), ``timeout`` at most."""
        headers = {"Accept-Encoding": "identity"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return httpx.Client(timeout=min(timeout, self.timeout), headers=headers)

    def request_body(self, params: SolveParams, messages: list[dict[str, str]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        from phi4cli.core.options import SETTING

        # Each setting the request asks with names on the OpenAI wire, unless it is off (a
        # server that knows no min_p is not sent one it would refuse): repeat_penalty under
        # llama-server's name and vLLM's and SGLang's (repetition_penalty).
        for key, value in params.ask._asdict().items():
            row = SETTING[key]
            if row.openai and row.sent and value is not None and not row.is_off(value):
                body.update(dict.fromkeys(row.openai, value))
        if wants_confidence(params) and self.gives_logprobs:
            body.update(logprobs=True, top_logprobs=TOP_K)  # each token's likeliest, for it
        return body

    def stream(
        self, params: SolveParams, attempt: Attempt, member: ChunkSource | None = None
    ) -> Iterator[Event]:
        """Yield the events of one solve or chat request: ``reasoning``, ``token``, ``retract``,
        ``stats``, then ``done`` or ``error``. Closing the iterator, or cancelling ``attempt``
        (the flight's hold on it), closes the HTTP response, which stops the server's generation.

        A failure of the server rather than of the request (it cannot be reached, hung up, went
        quiet, stayed busy) is raised as ReplicaFault, for the flight to send the request again;
        one of the request is the stream's error event. ``member``: its first leg is one
        choice of a request shared with other samples of its question (``n``).
        """
        started = time.monotonic()
        reader = _Reader(self.thinks)
        state = StreamState(started, _token_limit(params.ask.max_tokens))
        state.attempt, attempt.state = attempt, state
        budget = params.ask.think_budget
        if wants_confidence(params):
            state.trace = TraceConfidence()
        state.policy = ThinkingPolicy.asked(params.ask)
        messages = messages_for(params)
        client = self.http_client()
        try:
            if budget == 0 and self.thinks:
                if member is not None:
                    member.leave()  # its choice is not read: nothing of it is kept
                # No thinking at all: start the answer straight away.
                if state.policy.counted(0, in_reasoning=True) is Act.ANSWER:
                    state.policy.closed(fitted=True)
            else:
                body = self.request_body(params, messages)
                try:
                    for kind, text in self._events(client, body, reader, state, member):
                        yield Event(kind, text=text)
                except AskAlone:  # the shared request did not carry it: asked on its own
                    for kind, text in self._events(client, body, reader, state):
                        yield Event(kind, text=text)
                while state.think_on and not state.cut:
                    yield from self._think_on(client, params, messages, reader, state)
                for kind, text in reader.finish():
                    yield Event(kind, text=text)
            if state.answer_asked:
                yield from self._answer_after_budget(client, params, messages, reader, state)
        except StreamFailure as failure:
            if failure.fault is not None:
                # A broken replica is marked down (probed before it is sent more) and not sent
                # this request again: another one answers it, if there is another.
                raise ReplicaFault(
                    failure.code,
                    failure.message,
                    down=failure.fault in ("down", "silent", "broken"),
                    elsewhere=failure.fault in ("busy", "silent", "broken"),
                    stats=Event.of_stats(state.stats(self, reader, params)),
                ) from None
            yield Event.of_stats(state.stats(self, reader, params))
            yield Event.error(failure.code, failure.message)
            return
        except DaemonUnavailableError as error:
            raise ReplicaFault(
                ErrorCode.UNREACHABLE, str(error), down=True, elsewhere=False
            ) from None
        yield Event.of_stats(state.stats(self, reader, params))
        yield Event(EventKind.DONE, data={"finish_reason": state.finish})

    def _continuation(
        self,
        params: SolveParams,
        messages: list[dict[str, str]],
        prefix: str,
        state: StreamState,
    ) -> dict[str, Any]:
        """A request for the server to go on from ``prefix``, the start of the assistant's
        message, with the tokens left of max_tokens."""
        body = self._rest(params, [*messages, {"role": "assistant", "content": prefix}], state)
        # vLLM continues a final assistant message only when asked; llama-server always does.
        body.update(continue_final_message=True, add_generation_prompt=False)
        return body

    def _rest(
        self, params: SolveParams, messages: list[dict[str, str]], state: StreamState
    ) -> dict[str, Any]:
        """A later request of this one: ``messages``, with the tokens left of max_tokens."""
        body = self.request_body(params, messages)
        if params.ask.max_tokens is not None:
            body["max_tokens"] = max(1, self._tokens_left(params, state))
        return body

    def _think_on(
        self,
        client: httpx.Client,
        params: SolveParams,
        messages: list[dict[str, str]],
        reader: _Reader,
        state: StreamState,
    ) -> Iterator[Event]:
        """The thinking ended before --min-think (s1's budget forcing): send the reply so far,
        thinking open and "Wait" after it, as the start of the assistant's message for the
        server to go on from; what it writes next is thinking until it closes it again."""
        state.think_on = False
        state.policy.waited()
        thinking = state.reasoning_text.rstrip()
        body = self._continuation(params, messages, f"{THINK_OPEN}\n{thinking} Wait", state)
        state.seen(EventKind.REASONING, " Wait")
        yield Event(EventKind.REASONING, text=" Wait")
        reader.rethink()
        reader.reasoning_pieces += 1  # the Wait
        for kind, text in self._events(client, body, reader, state):
            yield Event(kind, text=text)

    def _answer_after_budget(
        self,
        client: httpx.Client,
        params: SolveParams,
        messages: list[dict[str, str]],
        reader: _Reader,
        state: StreamState,
    ) -> Iterator[Event]:
        """Ask for the answer with the thinking closed: the reply so far, ended by </think>, is
        sent as the start of the assistant's message for the server to continue. A server that
        does not continue a message (it starts a new one, and thinks again to its limit) is then
        asked afresh: the closed thinking as the assistant's turn, and a user's turn asking for
        the final answer. So is one that refuses to continue one (a 400: phi4 serve, whose
        last message must be the user's); it is not asked to continue again."""
        thinking = state.reasoning_text
        closed = f"{THINK_OPEN}\n{thinking.strip()}\n{THINK_CLOSE}\n\n"
        answered = False
        if self.continues:
            body = self._continuation(params, messages, closed, state)
            try:
                answered = yield from self._answer_from(client, body, reader, state, continued=True)
            except StreamFailure as failure:
                if failure.code != ErrorCode.BAD_REQUEST:
                    raise
                self.continues = False  # (nothing of the refused request was passed on)
        if answered or state.cut or not self._tokens_left(params, state):
            return
        fresh = [
            *messages,
            {"role": "assistant", "content": closed.rstrip()},
            {"role": "user", "content": FINAL_ANSWER_ASK},
        ]
        yield from self._answer_from(client, self._rest(params, fresh, state), reader, state)

    def _answer_from(
        self,
        client: httpx.Client,
        body: dict[str, Any],
        reader: _Reader,
        state: StreamState,
        continued: bool = False,
    ) -> Generator[Event, None, bool]:
        """Stream the answer ``body`` asks for, passing over any thinking (the budget for it is
        spent); return whether any answer came. ``continued``: ``body`` asks the server to go on
        from the closed thinking, and thinking before any answer says it did not (it began a
        message of its own): hang up there."""
        answer = _Reader(thinks=False)
        answer.separate = False
        events = self._events(client, body, answer, state)
        try:
            for kind, text in events:
                if kind == EventKind.REASONING:
                    if continued and not answer.answer_pieces:
                        return False  # (closing the events hangs up)
                    continue  # a server that thinks again: the budget is spent, keep the answer
                yield Event(kind, text=text)
        finally:
            events.close()
        for kind, text in answer.finish():
            if kind != EventKind.REASONING:
                yield Event(kind, text=text)
        reader.answer_pieces += answer.answer_pieces
        return answer.answer_pieces > 0

    @staticmethod
    def _tokens_left(params: SolveParams, state: StreamState) -> int:
        """Pieces the request may still stream (max_tokens less what came; no limit: a lot)."""
        limit = params.ask.max_tokens
        return max(0, limit - state.completion_pieces) if limit is not None else state.limit

    def _events(
        self,
        client: httpx.Client,
        body: dict[str, Any],
        reader: _Reader,
        state: StreamState,
        member: ChunkSource | None = None,
    ) -> Generator[tuple[EventKind, str]]:
        if member is not None:  # the first leg of a sample asked with others (``n``)
            yield from self._watched_events(member.chunks(state), reader, state, None)
            return
        with Watch(self, state) as watch:
            chunks = response_chunks(self, client, body, watch)
            yield from self._watched_events(chunks, reader, state, watch)

    def _watched_events(
        self,
        chunks: Iterator[dict[str, Any] | None],
        reader: _Reader,
        state: StreamState,
        watch: Watch | None,
    ) -> Iterator[tuple[EventKind, str]]:
        """Turn a stream's chunks into this request's pieces, as its thinking policy and limits
        allow; leaving early (closing ``chunks``) hangs up."""
        policy = state.policy
        try:
            for chunk in chunks:
                if state.attempt is not None and state.attempt.cancelled:
                    return  # the flight has ended it already; leaving hangs up
                if state.attempt is not None and state.attempt.answer_now:
                    policy.answer_now()  # closed at the next count while it thinks
                if chunk is None:  # [DONE]
                    return
                state.usage(chunk)
                for choice in choices_of(chunk, self.url):
                    if state.trace is not None:
                        _take_logprobs(choice, state.trace)
                        if state.attempt is not None and state.trace.below(state.attempt.floor):
                            # DeepConf online: too unsure to vote; leaving hangs up.
                            state.finish, state.cut = "unsure", True
                            return
                    finish = choice.get("finish_reason")
                    if finish is not None and not isinstance(finish, str):
                        raise nonsense(self.url, "a finish_reason that is not text")
                    if finish:
                        state.finish = finish[:40]
                        if watch is not None:
                            watch.finished = True
                    for kind, text in reader.feed(delta_of(choice, self.url)):
                        if kind != EventKind.RETRACT and state.completion_pieces >= state.limit:
                            # The server went past max_tokens (or streams without end):
                            # stop here, as a length stop; leaving closes the response.
                            state.finish, state.cut = "length", True
                            return
                        pieces = reader.reasoning_pieces
                        if kind == EventKind.TOKEN and policy.closing(pieces) is Act.WAIT:
                            state.think_on = True  # the answer began too soon: go on
                            return  # leaving closes the response
                        state.seen(kind, text)
                        yield kind, text
                        if kind == EventKind.RETRACT:
                            continue
                        act = policy.text(text, reader.in_reasoning, state.completion_pieces)
                        if act is Act.ANSWER:
                            # The answer is asked for next, in a request of its own.
                            policy.closed(fitted=True)
                            return  # leaving closes the response
                        if act is Act.STOP:
                            state.finish, state.cut = "loop", True
                            return
                    if policy.counted(reader.reasoning_pieces, reader.in_reasoning) is Act.ANSWER:
                        policy.closed(fitted=True)
                        return  # leaving closes the response
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()


def wants_confidence(params: SolveParams) -> bool:
    """Whether the answer's confidence is worked out: asked for, or a floor to stop below."""
    return params.confidence or params.confidence_floor is not None


def _token_limit(max_tokens: int | None) -> int:
    return max_tokens if max_tokens is not None and max_tokens > 0 else DEFAULT_TOKEN_LIMIT


def _take_logprobs(choice: dict[str, Any], trace: TraceConfidence) -> None:
    """Add the confidence of each token a chunk's ``logprobs`` tell (OpenAI's form: ``content``,
    each entry with its ``top_logprobs``); what is not in that form is passed over."""
    logprobs = choice.get("logprobs")
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    for entry in entries if isinstance(entries, list) else ():
        tops = entry.get("top_logprobs") if isinstance(entry, dict) else None
        values: list[Any] = (
            [top.get("logprob") for top in tops if isinstance(top, dict)]
            if isinstance(tops, list)
            else []
        )
        numbers = [
            float(v)
            for v in values
            if isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
            and v <= 0
        ]
        confidence = from_logprobs(numbers)
        if confidence is not None:
            trace.add(confidence)


class StreamState:
    """What one request's streams have produced, for its Stats."""

    def __init__(self, started: float, limit: int = DEFAULT_TOKEN_LIMIT) -> None:
        self.started = started
        self.limit = limit  # pieces of text the request may stream, thinking included
        self.socket: socket.socket | None = None  # the connection's, for Watch's guard
        self.attempt: Attempt | None = None  # the flight's hold on this request
        self.cut = False  # the stream was closed here at the limit
        self.first_token_s: float | None = None
        self.finish: str | None = None
        self.trace: TraceConfidence | None = None  # token confidences, when asked for
        self.think_on = False  # the thinking ended before --min-think: ask for more
        # --think-budget, --min-think, --loop: what to do while it thinks
        self.policy = ThinkingPolicy(None, 0, "off")
        self.completion_pieces = 0
        self.reasoning_parts: list[str] = []
        self.answer_parts: list[str] = []
        self.reported: dict[str, Any] = {}
        self.timings: dict[str, Any] = {}

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning_parts)

    @property
    def answer_asked(self) -> bool:
        """phi4 closed the thinking (a budget, a loop, the answer asked for now): the answer is
        asked for next."""
        policy = self.policy
        closed = policy.budget_reached or policy.loop == "answered" or policy.answered_early
        return closed and not self.cut

    def seen(self, kind: EventKind, text: str) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.monotonic() - self.started
        if kind == EventKind.RETRACT:  # the answer so far was thinking after all
            self.reasoning_parts += self.answer_parts
            self.answer_parts = []
            return
        self.completion_pieces += 1
        (self.reasoning_parts if kind == EventKind.REASONING else self.answer_parts).append(text)

    def usage(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.reported = usage
        timings = chunk.get("timings")  # llama-server's own
        if isinstance(timings, dict):
            self.timings = timings

    def stats(self, server: RemoteServer, reader: _Reader, params: SolveParams) -> Stats:
        """The request's Stats: the server's numbers where it reported believable ones (a
        count that is not a whole number from 0 to 10**9, or a time that is not a finite
        positive number, is ignored), else what the stream showed."""
        total = time.monotonic() - self.started
        usage, timings = self.reported, self.timings
        details = usage.get("completion_tokens_details")
        details = details if isinstance(details, dict) else {}
        completion = count_of(usage.get("completion_tokens")) or self.completion_pieces
        reasoning = count_of(details.get("reasoning_tokens")) or reader.reasoning_pieces
        policy = self.policy
        if (
            policy.budget_reached
            or self.cut
            or policy.loop is not None
            or policy.waits
            or policy.answered_early
        ):
            # Cut off before its usage came (two requests, or the limit here): count the stream.
            completion, reasoning = self.completion_pieces, reader.reasoning_pieces
        first = self.first_token_s
        prompt_eval_s = seconds_of(timings.get("prompt_ms"))
        if prompt_eval_s is None:
            prompt_eval_s = first or total
        decode_s = seconds_of(timings.get("predicted_ms"))
        if decode_s is None:
            decode_s = total - (first or total)
        prompt_details = usage.get("prompt_tokens_details")
        cached = (
            count_of(prompt_details.get("cached_tokens"))
            if isinstance(prompt_details, dict)
            else None
        )
        if cached is None:
            cached = count_of(timings.get("cache_n")) or 0
        prompt = count_of(usage.get("prompt_tokens")) or 0
        return Stats(
            prompt_tokens=prompt,
            cached_tokens=cached,
            # What the server evaluated: its own count (llama-server's), else the prompt less
            # what it found cached.
            prompt_eval_tokens=count_of(timings.get("prompt_n")) or max(0, prompt - cached),
            prompt_eval_s=round(prompt_eval_s, 4),
            completion_tokens=completion,
            reasoning_tokens=min(reasoning, completion),
            answer_tokens=max(0, completion - reasoning),
            budget_reached=policy.budget_reached,
            loop=policy.loop,
            loop_at=policy.loop_at,
            waits=policy.waits,
            answered_early=policy.answered_early,
            thinking_unfinished=reader.unfinished
            and not policy.budget_reached
            and not policy.answered_early
            and policy.loop != "answered",
            decode_s=round(decode_s, 4),
            first_token_s=None if first is None else round(first, 4),
            total_s=round(total, 4),
            finish_reason=self.finish if self.finish in ("length", "loop", "unsure") else "stop",
            seed=params.ask.seed,
            model=f"{server.model} at {server.url}",
            **self._confidence(),
            extra={
                "usage_reported": bool(usage),
                **(
                    {"confidence_unavailable": f"the backend {server.url} sent no logprobs"}
                    if self.trace is not None and not self.trace.tokens
                    else {}
                ),
            },
        )

    def _confidence(self) -> dict[str, Any]:
        """The Stats fields of the answer's confidence, where its server sent logprobs."""
        if self.trace is None or not self.trace.tokens:
            return {}
        stats = self.trace.stats()
        return {
            "confidence": stats["confidence"],
            "lowest_group_confidence": stats["lowest_group_confidence"],
        }
