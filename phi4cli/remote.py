"""Remote engines: `--backend URL` sends `phi4 solve` and `phi4 chat` to any OpenAI-compatible
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

A server is not trusted to behave: everything it sends is bounded and checked on this side. An
error body is read up to 64 KiB and shown as a one-line excerpt; a stream is cut at the request's
``max_tokens`` (a length stop, whatever the server does with the option), at 64 MiB in all and at
1 MiB an event; ``backend_timeout`` bounds the silence between events and ``backend_deadline`` the
whole request; every field read from its JSON is type-checked. 429 and 503 are retried a few
times, after the server's ``Retry-After`` when it gives one.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
import unicodedata
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager, suppress
from email.utils import parsedate_to_datetime
from typing import Any, cast

import httpx2 as httpx

from phi4cli.confidence import TOP_K, TraceConfidence, from_logprobs
from phi4cli.dispatch import Delivery, Failure, Flight, Probe, Replica, Slow
from phi4cli.errors import DaemonUnavailableError
from phi4cli.exits import Announce
from phi4cli.protocol import JSON, ErrorCode, Event, EventKind, Stats
from phi4cli.reasoning import THINK_CLOSE, THINK_OPEN, ThinkSplitter, model_thinks
from phi4cli.thinking import Act, ThinkingPolicy

# What a server that does not continue an assistant's message is asked once phi4 has closed the
# thinking (a budget, a loop): the thinking so far is its turn, then this one.
FINAL_ANSWER_ASK = ("Stop thinking now. Give your final answer, with the final result in "
                    "\\boxed{}.")  # fmt: skip
CONNECT_TIMEOUT_S = 10.0  # at most; a shorter backend_timeout shortens it too
ERROR_BODY_LIMIT = 64 * 1024  # bytes of an error answer read before the connection is closed
EXCERPT_CHARS = 200  # of a server's message, shown on one line
MAX_EVENT_BYTES = 1024 * 1024  # one server-sent event (a line that never ends included)
MAX_STREAM_BYTES = 64 * 1024 * 1024  # one response stream in all
MAX_METRICS_BYTES = 4 * 1024 * 1024  # a /metrics page (vLLM's is some hundreds of KiB)
MAX_SHARED = 16  # samples of a question asked in one request (its n), at most
MAX_LISTED_MODELS = 16  # of a /v1/models list, the ids `phi4 status --backend` shows
# Pieces of text one request may stream when it sets no max_tokens: beyond any context these
# servers run, so only an endless stream meets it.
DEFAULT_TOKEN_LIMIT = 131072
MAX_RETRIES = 3  # of a 429 or 503 answer
MAX_RETRY_WAIT_S = 60.0  # a longer Retry-After is not waited for
RETRY_BACKOFF_S = 0.5  # the first wait when the server gives no Retry-After; doubled each time
LONGEST_WAIT_S = 1e8  # about three years: longer settings are taken as this
_MAX_COUNT = 10**9  # a token count above this, as a NaN or a negative one, is not believed
_CODE_FOR_STATUS = {400: ErrorCode.BAD_REQUEST, 404: ErrorCode.BAD_REQUEST,
                    413: ErrorCode.BAD_REQUEST, 429: ErrorCode.BUSY,
                    503: ErrorCode.SHUTTING_DOWN, 504: ErrorCode.TIMEOUT}  # fmt: skip


# What phi4 shows of a server's load (``phi4 status --backend``), and the metric each kind of
# server publishes it as at /metrics: (sample name, labels it must have); the first found counts.
# llama-server publishes its metrics with --metrics, SGLang with --enable-metrics; vLLM and
# phi4 serve always; Ollama and LiteLLM publish none of these.
LOAD_METRICS: dict[str, tuple[tuple[str, dict[str, str]], ...]] = {
    "in_flight": (("phi4_requests_active", {}), ("llamacpp:requests_processing", {}),
                  ("vllm:num_requests_running", {}), ("sglang:num_running_reqs", {})),
    "waiting": (("phi4_queue_depth", {}), ("llamacpp:requests_deferred", {}),
                ("vllm:num_requests_waiting", {}), ("sglang:num_queue_reqs", {})),
    "answered": (("phi4_requests_total", {}), ("vllm:request_success_total", {}),
                 ("sglang:num_requests_total", {})),
    "tokens": (("phi4_tokens_total", {"kind": "completion"}),
               ("llamacpp:tokens_predicted_total", {}), ("vllm:generation_tokens_total", {}),
               ("sglang:generation_tokens_total", {})),
}  # fmt: skip
LOAD_WINDOW_S = 1.0  # tokens/s: the server's count of generated tokens over this long


def backend_key() -> str | None:
    """The API key for the remote backend, from PHI4_BACKEND_KEY."""
    from phi4cli.config import variable

    return variable("PHI4_BACKEND_KEY")


def messages_for(params: dict[str, Any]) -> list[dict[str, str]]:
    system = params.get("system")
    messages = [{"role": "system", "content": system}] if system else []
    messages += list(params.get("history") or [])
    question = params.get("message", params.get("prompt"))
    messages.append({"role": "user", "content": str(question)})
    return messages


class _Failure(Exception):
    """The stream ended in an error: the terminal event to report. ``fault``: the server
    failed, not the request ("down": it went away, hung up or went quiet mid-answer; "busy": it
    stayed busy; "broken": it is up but answered 500 or a stream that cannot be read), so
    another replica, or the same one once it is back, may answer it."""

    def __init__(self, code: ErrorCode, message: str, fault: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.fault = code, message, fault


class ReplicaFault(Exception):
    """An attempt the server failed (see ``_Failure.fault``): for the flight to send again."""

    def __init__(self, code: ErrorCode, message: str, down: bool, elsewhere: bool,
                 stats: Event | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.code, self.message, self.down, self.elsewhere = code, message, down, elsewhere
        self.stats = stats  # what the attempt cost, for its error record if it stays the end


class Attempt:
    """One request's hold on its HTTP stream, for the flight's thread: cancel it (hang up), and
    hear when the server answers busy."""

    def __init__(self, on_busy: Callable[[float], None] | None = None) -> None:
        self.cancelled = False
        self.on_busy = on_busy
        self.state: _StreamState | None = None
        # --stop-unsure: the stream is cut once its confidence falls below this (the request's
        # confidence_floor, or the flight's adjust since).
        self.floor: float | None = None

    def cancel(self) -> None:
        self.cancelled = True
        connection = self.state.socket if self.state is not None else None
        if connection is not None:
            with suppress(OSError):  # wakes the read blocked on it
                connection.shutdown(socket.SHUT_RDWR)


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
    names = {"answer": EventKind.TOKEN, "reasoning": EventKind.REASONING,
             "retract": EventKind.RETRACT}  # fmt: skip
    return [(names[kind], text) for kind, text in pieces]


class RemoteEngine:
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
        self._retry_told = False
        self.gives_logprobs = True  # until it refuses them: then it is not asked again
        # Whether it answers a request with ``n`` choices (None: not known yet). Found out by
        # the first samples asked together, and remembered: one that refuses n, or answers
        # one choice, is sent each sample on its own from then on.
        self.takes_n: bool | None = None
        self.connections = max(1, connections)  # kept open to the server, for the requests at once
        self._client: httpx.Client | None = None
        self._client_lock = threading.Lock()

    def _http(self) -> httpx.Client:
        """The engine's one HTTP client: its connection pool is shared by every request in
        flight (httpx's pool is thread-safe), so a run of thousands opens few connections."""
        with self._client_lock:
            if self._client is None:
                # No compression: a small compressed body must not become a huge one in memory.
                headers = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}
                if self.api_key:
                    headers["Authorization"] = f"Bearer {self.api_key}"
                timeout = httpx.Timeout(self.timeout,
                                        connect=min(CONNECT_TIMEOUT_S, self.timeout))  # fmt: skip
                limits = httpx.Limits(max_connections=self.connections + 4,
                                      max_keepalive_connections=self.connections)  # fmt: skip
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

    def probe(self, timeout: float = 5.0) -> str | None:
        """Whether the server is there and ready: None when it is, else why not. ``/health``
        (llama-server, vLLM, SGLang, phi4 serve) answering 200 says ready and 503 not yet;
        a server without that route is asked for ``/v1/models`` (Ollama, LiteLLM); one that
        answers HTTP but has neither route counts as there."""
        try:
            with self._side_client(timeout) as client:
                for url in (self.root + "/health", self.v1 + "/models"):
                    status = client.get(url).status_code
                    if status < 300:
                        return None
                    if status >= 500 and status != 501:  # 503: loading, or overloaded
                        return f"it answered {status} to {url}"
                return None
        except (httpx.HTTPError, httpx.InvalidURL, OSError) as error:
            return f"cannot reach it: {_reason(error)}"

    def served_models(self, timeout: float = 5.0) -> list[str] | None:
        """The model ids the server lists at ``/v1/models`` (what it serves, whatever name a
        request carries), or None when it lists none that can be read."""
        body = bytearray()
        try:
            with self._side_client(timeout) as client, \
                    client.stream("GET", self.v1 + "/models") as response:  # fmt: skip
                if response.status_code != 200:
                    return None
                for piece in response.iter_bytes():
                    body += piece
                    if len(body) > MAX_METRICS_BYTES:
                        return None
            listed = json.loads(body)
        except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError):
            return None
        entries = listed.get("data") if isinstance(listed, dict) else None
        if not isinstance(entries, list):
            return None
        from phi4cli.sanitize import clean_text

        ids = [clean_text(entry["id"]) for entry in entries
               if isinstance(entry, dict) and isinstance(entry.get("id"), str)]  # fmt: skip
        return ids[:MAX_LISTED_MODELS] or None

    def load(self, timeout: float = 5.0) -> dict[str, float]:
        """What the server says of its own load at ``/metrics`` (Prometheus text): requests in
        flight and waiting, requests answered and tokens generated since it started, where it
        publishes them (:data:`LOAD_METRICS`); empty when it has no such page."""
        from prometheus_client.parser import text_string_to_metric_families

        body = bytearray()
        try:
            with self._side_client(timeout) as client, \
                    client.stream("GET", self.root + "/metrics") as response:  # fmt: skip
                if response.status_code != 200:
                    return {}
                for piece in response.iter_bytes():  # read as it comes, and only so much
                    body += piece
                    if len(body) > MAX_METRICS_BYTES:
                        return {}
        except (httpx.HTTPError, httpx.InvalidURL, OSError):
            return {}
        text = body.decode("utf-8", "replace")
        found: dict[str, float] = {}
        try:
            samples = [s for family in text_string_to_metric_families(text)
                       for s in family.samples]  # fmt: skip
        except (ValueError, TypeError, IndexError):
            return {}  # not Prometheus text after all
        for key, names in LOAD_METRICS.items():
            for name, labels in names:
                values = [s.value for s in samples if s.name == name
                          and all(s.labels.get(k) == v for k, v in labels.items())]  # fmt: skip
                if values and all(math.isfinite(v) and v >= 0 for v in values):
                    found[key] = sum(values)
                    break
        return found

    @property
    def v1(self) -> str:
        """The server's address with its ``/v1``: where the OpenAI routes are."""
        return self.url if self.url.endswith("/v1") else self.url + "/v1"

    @property
    def endpoint(self) -> str:
        return self.v1 + "/chat/completions"

    def _side_client(self, timeout: float) -> httpx.Client:
        """A client for one short look beside the answers (a health probe, the metrics page):
        the key, no compression (a small body must not become a huge one), ``timeout`` at most."""
        headers = {"Accept-Encoding": "identity"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return httpx.Client(timeout=min(timeout, self.timeout), headers=headers)

    def _body(self, params: dict[str, Any], messages: list[dict[str, str]]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True,
                                "stream_options": {"include_usage": True}}  # fmt: skip
        from phi4cli.options import SETTINGS

        # Each setting with names on the OpenAI wire, unless it is off (a server that knows
        # no min_p is not sent one it would refuse): repeat_penalty under llama-server's name
        # and vLLM's and SGLang's (repetition_penalty).
        for row in SETTINGS:
            value = params.get(row.key)
            if row.openai and row.sent and value is not None and not row.is_off(value):
                body.update(dict.fromkeys(row.openai, value))
        if _wants_confidence(params) and self.gives_logprobs:
            body.update(logprobs=True, top_logprobs=TOP_K)  # each token's likeliest, for it
        return body

    def stream(self, params: dict[str, Any], attempt: Attempt,
               member: _Member | None = None) -> Iterator[Event]:  # fmt: skip
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
        state = _StreamState(started, _token_limit(params.get("max_tokens")))
        state.attempt, attempt.state = attempt, state
        budget = params.get("think_budget")
        if _wants_confidence(params):
            state.trace = TraceConfidence()
        state.policy = ThinkingPolicy(budget, int(params.get("min_think") or 0),
                                      str(params.get("loop", "answer")))  # fmt: skip
        messages = messages_for(params)
        client = self._http()
        try:
            if budget == 0 and self.thinks:
                # No thinking at all: start the answer straight away.
                if state.policy.counted(0, in_reasoning=True) is Act.ANSWER:
                    state.policy.closed(fitted=True)
            else:
                body = self._body(params, messages)
                try:
                    for kind, text in self._events(client, body, reader, state, member):
                        yield Event(kind, text=text)
                except _Alone:  # the shared request did not carry it: asked on its own
                    for kind, text in self._events(client, body, reader, state):
                        yield Event(kind, text=text)
                while state.think_on and not state.cut:
                    yield from self._think_on(client, params, messages, reader, state)
                for kind, text in reader.finish():
                    yield Event(kind, text=text)
            if state.answer_asked:
                yield from self._answer_after_budget(client, params, messages, reader, state)
        except _Failure as failure:
            if failure.fault is not None:
                # A broken replica is marked down (probed before it is sent more) and not sent
                # this request again: another one answers it, if there is another.
                raise ReplicaFault(failure.code, failure.message,
                                   down=failure.fault in ("down", "silent", "broken"),
                                   elsewhere=failure.fault in ("busy", "silent", "broken"),
                                   stats=Event.of_stats(state.stats(self, reader, params))
                                   ) from None  # fmt: skip
            yield Event.of_stats(state.stats(self, reader, params))
            yield Event.error(failure.code, failure.message)
            return
        except DaemonUnavailableError as error:
            raise ReplicaFault(ErrorCode.UNREACHABLE, str(error), down=True,
                               elsewhere=False) from None  # fmt: skip
        yield Event.of_stats(state.stats(self, reader, params))
        yield Event(EventKind.DONE, data={"finish_reason": state.finish})

    def _continuation(
        self,
        params: dict[str, Any],
        messages: list[dict[str, str]],
        prefix: str,
        state: _StreamState,
    ) -> dict[str, Any]:
        """A request for the server to go on from ``prefix``, the start of the assistant's
        message, with the tokens left of max_tokens."""
        body = self._rest(params, [*messages, {"role": "assistant", "content": prefix}], state)
        # vLLM continues a final assistant message only when asked; llama-server always does.
        body.update(continue_final_message=True, add_generation_prompt=False)
        return body

    def _rest(
        self, params: dict[str, Any], messages: list[dict[str, str]], state: _StreamState
    ) -> dict[str, Any]:
        """A later request of this one: ``messages``, with the tokens left of max_tokens."""
        body = self._body(params, messages)
        if params.get("max_tokens") is not None:
            body["max_tokens"] = max(1, self._tokens_left(params, state))
        return body

    def _think_on(
        self,
        client: httpx.Client,
        params: dict[str, Any],
        messages: list[dict[str, str]],
        reader: _Reader,
        state: _StreamState,
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
        params: dict[str, Any],
        messages: list[dict[str, str]],
        reader: _Reader,
        state: _StreamState,
    ) -> Iterator[Event]:
        """Ask for the answer with the thinking closed: the reply so far, ended by </think>, is
        sent as the start of the assistant's message for the server to continue. A server that
        does not continue a message (it starts a new one, and thinks again to its limit) is then
        asked afresh: the closed thinking as the assistant's turn, and a user's turn asking for
        the final answer."""
        thinking = state.reasoning_text
        closed = f"{THINK_OPEN}\n{thinking.strip()}\n{THINK_CLOSE}\n\n"
        body = self._continuation(params, messages, closed, state)
        answered = yield from self._answer_from(client, body, reader, state, continued=True)
        if answered or state.cut or not self._tokens_left(params, state):
            return
        fresh = [*messages, {"role": "assistant", "content": closed.rstrip()},
                 {"role": "user", "content": FINAL_ANSWER_ASK}]  # fmt: skip
        yield from self._answer_from(client, self._rest(params, fresh, state), reader, state)

    def _answer_from(
        self,
        client: httpx.Client,
        body: dict[str, Any],
        reader: _Reader,
        state: _StreamState,
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
    def _tokens_left(params: dict[str, Any], state: _StreamState) -> int:
        """Pieces the request may still stream (max_tokens less what came; no limit: a lot)."""
        limit = params.get("max_tokens")
        return max(0, int(limit) - state.completion_pieces) if limit is not None else state.limit

    @contextmanager
    def _opened(
        self, client: httpx.Client, body: dict[str, Any], watch: _Watch
    ) -> Iterator[httpx.Response]:
        """The response to ``body`` once the server accepts it: a 429 or 503 is asked again, up
        to MAX_RETRIES times, after its Retry-After (or a short backoff). Raise _Failure for a
        refusal, with a short excerpt of the server's message. A refusal of the logprobs asked
        for is asked again at once without them, as an attempt of its own (it can happen once)."""
        attempts = iter(range(MAX_RETRIES + 1))
        attempt = next(attempts)
        while True:
            watch.ask()
            with client.stream("POST", self.endpoint, json=body,
                               extensions={"trace": watch.trace}) as response:  # fmt: skip
                watch.answered = True
                watch.last_event = time.monotonic()
                encoding = response.headers.get("content-encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):
                    # Not asked for, and a few KiB of it can inflate to gigabytes in one read.
                    shown = excerpt(encoding, 40)
                    raise _Failure(ErrorCode.BACKEND_ERROR,
                                   f"the backend {self.url} sent a compressed answer ({shown}), "
                                   "which phi4 did not ask for")  # fmt: skip
                if response.status_code < 400:
                    stream = response.extensions.get("network_stream")
                    if stream is not None:
                        # The connection this answer came on (from the pool, the trace saw no
                        # connect): the one a cancel or the guard hangs up.
                        watch.state.socket = stream.get_extra_info("socket")
                    yield response
                    return
                text, whole = _read_bounded(response, watch)
                wait = _retry_wait(response, attempt)
            failure = _http_failure(response, text, whole)
            if body.get("logprobs") and response.status_code in (400, 422) \
                    and "logprob" in failure.message.lower():  # fmt: skip
                # A server that gives no logprobs (or not 20): asked again without, and never
                # again for them; the answers then have no confidence.
                told, self.gives_logprobs = not self.gives_logprobs, False
                body = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
                if self.notice is not None and not told:
                    self.notice(f"the backend {self.url} gives no logprobs ({failure.message}); "
                                "answers have no confidence")  # fmt: skip
                continue  # (the same attempt number: a busy server's retries are not spent)
            if wait is not None and watch.state.attempt is not None \
                    and watch.state.attempt.on_busy is not None:  # fmt: skip
                watch.state.attempt.on_busy(wait)  # the flight sends less to this server now
            left = self.deadline - (time.monotonic() - watch.started)
            if wait is None or attempt == MAX_RETRIES or wait > min(MAX_RETRY_WAIT_S, left):
                raise failure
            if self.notice is not None and not self._retry_told:
                self._retry_told = True  # once per command, however many waits follow
                self.notice(f"the backend {self.url} is busy ({response.status_code}); "
                            f"asking again in {wait:g} s (up to {MAX_RETRIES} times)")  # fmt: skip
            time.sleep(wait)
            attempt = next(attempts)

    def _events(
        self,
        client: httpx.Client,
        body: dict[str, Any],
        reader: _Reader,
        state: _StreamState,
        member: _Member | None = None,
    ) -> Generator[tuple[EventKind, str]]:
        if member is not None:  # the first leg of a sample asked with others (``n``)
            yield from self._watched_events(member.chunks(state), reader, state, None)
            return
        with _Watch(self, state) as watch:
            yield from self._watched_events(self._chunks(client, body, watch), reader, state,
                                            watch)  # fmt: skip

    def _chunks(self, client: httpx.Client, body: dict[str, Any],
                watch: _Watch) -> Iterator[dict[str, Any] | None]:  # fmt: skip
        """The chunks of the response to ``body``, parsed, then None for its ``[DONE]``; a
        failure of the server or of the connection is raised as _Failure (or
        DaemonUnavailableError: it was never reached)."""
        done = False
        try:
            with self._opened(client, body, watch) as response:
                watched = cast(httpx.Response, _WatchedResponse(response, watch))
                for sse in httpx.EventSource(watched, max_event_size=MAX_EVENT_BYTES):
                    watch.last_event = time.monotonic()
                    if sse.data.strip() == "[DONE]":
                        done = True
                        yield None
                        return
                    yield _chunk(sse.data, self.url)
        except httpx.TransportError as error:  # timeouts, broken connections, bad streams
            if watch.finished and not isinstance(error, httpx.SSEError):
                # The answer ended, then the server went quiet or hung up instead of sending
                # [DONE]: its usage is lost, not the answer.
                return
            raise _transport_failure(error, watch) from None
        except (httpx.RequestError, httpx.InvalidURL) as error:  # a body it cannot decode, ...
            if watch.alarm is not None:
                raise watch.alarm from None
            raise _Failure(
                ErrorCode.BACKEND_ERROR, f"the backend's reply cannot be read: {_reason(error)}"
            ) from None
        if not done and not watch.finished:
            if watch.alarm is not None:
                raise watch.alarm
            raise _Failure(ErrorCode.BACKEND_ERROR,
                           "the backend closed the stream before the answer was complete",
                           fault="down")  # fmt: skip

    def _watched_events(
        self,
        chunks: Iterator[dict[str, Any] | None],
        reader: _Reader,
        state: _StreamState,
        watch: _Watch | None,
    ) -> Iterator[tuple[EventKind, str]]:
        """Turn a stream's chunks into this request's pieces, as its thinking policy and limits
        allow; leaving early (closing ``chunks``) hangs up."""
        policy = state.policy
        try:
            for chunk in chunks:
                if state.attempt is not None and state.attempt.cancelled:
                    return  # the flight has ended it already; leaving hangs up
                if chunk is None:  # [DONE]
                    return
                state.usage(chunk)
                for choice in _choices(chunk, self.url):
                    if state.trace is not None:
                        _take_logprobs(choice, state.trace)
                        if state.attempt is not None \
                                and state.trace.below(state.attempt.floor):  # fmt: skip
                            # DeepConf online: too unsure to vote; leaving hangs up.
                            state.finish, state.cut = "unsure", True
                            return
                    finish = choice.get("finish_reason")
                    if finish is not None and not isinstance(finish, str):
                        raise _nonsense(self.url, "a finish_reason that is not text")
                    if finish:
                        state.finish = finish[:40]
                        if watch is not None:
                            watch.finished = True
                    for kind, text in reader.feed(_delta(choice, self.url)):
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


def _wants_confidence(params: dict[str, Any]) -> bool:
    """Whether the answer's confidence is worked out: asked for, or a floor to stop below."""
    return bool(params.get("confidence")) or params.get("confidence_floor") is not None


def _transport_failure(error: httpx.TransportError, watch: _Watch) -> Exception:
    """What to report for an error of the connection: unreachable (exit 3) when no answer began,
    else why the stream ended: the guard's reason when it hung up, silence, or the break."""
    if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
        return DaemonUnavailableError(f"cannot reach the backend {watch.url}: {_reason(error)}")
    if watch.alarm is not None:
        return watch.alarm
    if isinstance(error, httpx.TimeoutException):
        return watch.silent() if watch.answered else watch.unanswered()
    if isinstance(error, httpx.SSEError):
        return _Failure(ErrorCode.BACKEND_ERROR, f"the backend's reply is not a stream: {error}",
                        fault="broken")  # fmt: skip
    return _Failure(
        ErrorCode.BACKEND_ERROR,
        f"the connection to the backend broke: {_reason(error)}",
        fault="down",
    )


class _Watch:
    """The time and size limits of one request's responses. Sizes and the time between events
    are checked as each piece arrives (httpx's read timeout only sees a silent socket, not one
    that trickles a byte at a time); a guard thread hangs up the connection when the answer's
    status line is not in within ``timeout`` of asking, or the whole request passes its
    ``deadline``, since a read that trickles or waits cannot check the clock itself.

    Use as a context manager: the guard runs inside it.
    """

    def __init__(self, engine: RemoteEngine, state: _StreamState) -> None:
        self.url, self.timeout, self.deadline = engine.url, engine.timeout, engine.deadline
        self.started = state.started  # the deadline counts from the request's start
        self.asked = time.monotonic()  # when the latest attempt was sent
        self.last_event = self.asked
        self.received = 0
        self.answered = False  # the latest attempt got a status line: the server is there
        self.finished = False  # a finish_reason came: the answer is whole, whatever follows
        self.alarm: Exception | None = None  # why the guard hung up, when it did
        self.state = state
        self._done = threading.Event()
        self._guard = threading.Thread(target=self._hang_up_when_due, daemon=True,
                                       name="phi4-backend-guard")  # fmt: skip

    def __enter__(self) -> _Watch:
        self._guard.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._done.set()

    def trace(self, name: str, info: dict[str, Any]) -> None:
        """httpcore's trace hook: keep the socket of each new connection, for the guard."""
        stream = info.get("return_value")
        if name == "connection.connect_tcp.complete" and stream is not None:
            self.state.socket = stream.get_extra_info("socket")

    def ask(self) -> None:
        """A new attempt is being sent (on a connection of its own: the pool's, or new)."""
        self.asked = self.last_event = time.monotonic()
        self.answered = False
        self.state.socket = None  # the last attempt's connection may be another request's now

    def silent(self) -> _Failure:
        return _Failure(
            ErrorCode.TIMEOUT,
            f"the backend {self.url} sent nothing for {self.timeout:g} s "
            "(PHI4_BACKEND_TIMEOUT sets how long to wait)",
            # Another replica may answer; this one, which went quiet, is not waited for again.
            fault="silent",
        )

    def unanswered(self) -> DaemonUnavailableError:
        return DaemonUnavailableError(
            f"the backend {self.url} took the connection but did not answer for "
            f"{self.timeout:g} s (PHI4_BACKEND_TIMEOUT sets how long to wait)"
        )

    def too_long(self) -> _Failure:
        return _Failure(
            ErrorCode.TIMEOUT,
            f"the backend {self.url} took more than {self.deadline:g} s in all "
            "(PHI4_BACKEND_DEADLINE sets how long a request may take)",
        )

    def check(self, size: int) -> None:
        """Count ``size`` more bytes; raise _Failure past a limit."""
        now = time.monotonic()
        self.received += size
        if now - self.started > self.deadline:
            raise self.too_long()
        if now - self.last_event > self.timeout:
            raise self.silent()  # bytes came, but no whole event: a trickle is silence too
        # Asked for logprobs, a server sends about 1 KiB more per token.
        limit = MAX_STREAM_BYTES * (8 if self.state.trace is not None else 1)
        if self.received > limit:
            raise _Failure(
                ErrorCode.BACKEND_ERROR,
                f"the backend {self.url} sent more than {limit // 2**20} MiB for one answer",
            )

    def _due(self) -> tuple[float, Exception]:
        """When the guard hangs up if nothing changes, and why."""
        deadline_at = self.started + self.deadline
        if not self.answered and self.asked + self.timeout < deadline_at:
            return self.asked + self.timeout, self.unanswered()
        return deadline_at, self.too_long()

    def _hang_up_when_due(self) -> None:
        while True:
            due, _why = self._due()
            if self._done.wait(min(max(0.0, due - time.monotonic()), 3600.0)):
                return
            due, why = self._due()  # the answer may have come, or a new attempt begun
            if time.monotonic() >= due:
                self.alarm = why
                connection = self.state.socket
                if connection is not None:
                    # Shutting it down wakes the read blocked on it; closing would not.
                    with suppress(OSError):
                        connection.shutdown(socket.SHUT_RDWR)
                return


class _WatchedResponse:
    """What httpx's EventSource reads of a response, with each piece of text checked by a
    _Watch first, so the SSE parsing stays httpx's."""

    def __init__(self, response: httpx.Response, watch: _Watch) -> None:
        self._response, self._watch = response, watch
        self.headers, self.request = response.headers, response.request

    def iter_text(self) -> Iterator[str]:
        for text in self._response.iter_text():
            self._watch.check(len(text))
            yield text


def _read_bounded(response: httpx.Response, watch: _Watch) -> tuple[str, bool]:
    """Up to ERROR_BODY_LIMIT bytes of an error answer, and whether that was all of it."""
    parts: list[bytes] = []
    size = 0
    for piece in response.iter_bytes():
        watch.check(len(piece))  # the whole error answer comes within backend_timeout
        parts.append(piece)
        size += len(piece)
        if size >= ERROR_BODY_LIMIT:
            return b"".join(parts)[:ERROR_BODY_LIMIT].decode("utf-8", "replace"), False
    return b"".join(parts).decode("utf-8", "replace"), True


def _retry_wait(response: httpx.Response, attempt: int) -> float | None:
    """Seconds to wait before asking again, or None when the answer is not worth retrying."""
    if response.status_code not in (429, 503):
        return None
    value = response.headers.get("retry-after", "").strip()
    if value.isdigit():
        return float(min(int(value[:12]), 10**9))
    if value:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            when = None
        if when is not None and when.tzinfo is not None:
            return max(0.0, when.timestamp() - time.time())
    return float(RETRY_BACKOFF_S * 2**attempt)


def _token_limit(max_tokens: Any) -> int:
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0:
        return max_tokens
    return DEFAULT_TOKEN_LIMIT


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """``text`` as one short line: escape sequences and bidi controls cleaned as everywhere
    (one visible U+FFFD each, see phi4cli.sanitize), other control and format characters become
    spaces, runs of whitespace one space, and beyond ``limit`` it is cut."""
    from phi4cli.sanitize import clean_text

    cleaned = "".join(
        " " if unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp") else char
        for char in clean_text(text[: limit * 4])
    )
    line = " ".join(cleaned.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def _nonsense(url: str, what: str) -> _Failure:
    return _Failure(ErrorCode.BACKEND_ERROR, f"the backend {url} sent {what}", fault="broken")


def _reason(error: Exception) -> str:
    cause = error.__cause__ or error.__context__
    text = str(error) or (str(cause) if cause else type(error).__name__)
    if isinstance(error, httpx.ConnectTimeout):
        text = "it did not take the connection in time"
    return excerpt(text.removeprefix("[Errno 111] "))  # it may quote what the server sent


def _chunk(data: str, url: str) -> dict[str, Any]:
    """One streamed chunk; a malformed one, or one that carries an error, ends the stream."""
    try:
        chunk = json.loads(data)
    except (ValueError, RecursionError):  # also digits past int's limit, or nesting too deep
        shown = excerpt(data, 80)
        malformed = f"the backend sent a malformed event: {shown!r}"
        raise _Failure(ErrorCode.BACKEND_ERROR, malformed, "broken") from None
    if not isinstance(chunk, dict):
        raise _Failure(ErrorCode.BACKEND_ERROR, "the backend sent an event that is not an object",
                       "broken")  # fmt: skip
    error = chunk.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else error
        status = error.get("code") if isinstance(error, dict) else None
        code = _CODE_FOR_STATUS.get(status if type(status) is int else 0,
                                    ErrorCode.BACKEND_ERROR)  # fmt: skip
        shown = excerpt(message if isinstance(message, str) else json.dumps(message)[:1000])
        raise _Failure(code, f"the backend reported an error mid-answer: {shown}")
    return chunk


def _choices(chunk: dict[str, Any], url: str) -> list[dict[str, Any]]:
    choices = chunk.get("choices")
    if choices is None:
        return []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise _nonsense(url, "'choices' that are not a list of objects")
    return choices


def _delta(choice: dict[str, Any], url: str) -> dict[str, Any]:
    delta = choice.get("delta")
    if delta is None:
        return {}
    if not isinstance(delta, dict):
        raise _nonsense(url, "a 'delta' that is not an object")
    for key in ("content", "reasoning_content", "reasoning"):
        if delta.get(key) is not None and not isinstance(delta[key], str):
            raise _nonsense(url, f"a '{key}' that is not text")
    return delta


def _http_failure(response: httpx.Response, text: str, whole: bool) -> _Failure:
    """The refusal ``response`` means, with the server's message (from ``text``, the start of
    its body) cut to one line."""
    detail: Any = None
    if whole:
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, dict):
            error = parsed.get("error")
            detail = error.get("message") if isinstance(error, dict) else error
            if not isinstance(detail, str):
                detail = parsed.get("message", parsed.get("detail"))
    if not isinstance(detail, str):
        detail = text
    shown = excerpt(detail) or excerpt(response.reason_phrase) or "no message"
    status = response.status_code
    code = _CODE_FOR_STATUS.get(status, ErrorCode.BACKEND_ERROR)
    # Busy for good (429, 503): another replica may have room. A proxy's 502 or 504 (LiteLLM's
    # for an upstream that died, say): that server failed, not the request. A 500 (or another
    # 5xx): the server is up but broken; another replica may answer, and when none does, it is
    # the request's error.
    fault = ("busy" if status in (429, 503) else "down" if status in (502, 504)
             else "broken" if status >= 500 else None)  # fmt: skip
    return _Failure(code, f"the backend answered {status}: {shown}", fault)


def _count(value: Any) -> int | None:
    """A token count the server reported, or None when it is not a believable one."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if type(value) is int and 0 <= value <= _MAX_COUNT:
        return value
    return None


def _seconds(millis: Any) -> float | None:
    """Seconds from a reported number of milliseconds, or None when it is not a believable one."""
    if type(millis) in (int, float) and math.isfinite(millis) and 0 <= millis <= 1e10:
        return float(millis) / 1000.0
    return None


def _take_logprobs(choice: dict[str, Any], trace: TraceConfidence) -> None:
    """Add the confidence of each token a chunk's ``logprobs`` tell (OpenAI's form: ``content``,
    each entry with its ``top_logprobs``); what is not in that form is passed over."""
    logprobs = choice.get("logprobs")
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    for entry in entries if isinstance(entries, list) else ():
        tops = entry.get("top_logprobs") if isinstance(entry, dict) else None
        values: list[Any] = [top.get("logprob") for top in tops if isinstance(top, dict)] \
            if isinstance(tops, list) else []  # fmt: skip
        numbers = [float(v) for v in values if isinstance(v, (int, float))
                   and not isinstance(v, bool) and math.isfinite(v) and v <= 0]  # fmt: skip
        confidence = from_logprobs(numbers)
        if confidence is not None:
            trace.add(confidence)


class _StreamState:
    """What one request's streams have produced, for its Stats."""

    def __init__(self, started: float, limit: int = DEFAULT_TOKEN_LIMIT) -> None:
        self.started = started
        self.limit = limit  # pieces of text the request may stream, thinking included
        self.socket: socket.socket | None = None  # the connection's, for _Watch's guard
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
        """phi4 closed the thinking (a budget, a loop): the answer is asked for next."""
        return (self.policy.budget_reached or self.policy.loop == "answered") and not self.cut

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

    def stats(self, engine: RemoteEngine, reader: _Reader, params: dict[str, Any]) -> Stats:
        """The request's Stats: the server's numbers where it reported believable ones (a
        count that is not a whole number from 0 to 10**9, or a time that is not a finite
        positive number, is ignored), else what the stream showed."""
        total = time.monotonic() - self.started
        usage, timings = self.reported, self.timings
        details = usage.get("completion_tokens_details")
        details = details if isinstance(details, dict) else {}
        completion = _count(usage.get("completion_tokens")) or self.completion_pieces
        reasoning = _count(details.get("reasoning_tokens")) or reader.reasoning_pieces
        policy = self.policy
        if policy.budget_reached or self.cut or policy.loop is not None or policy.waits:
            # Cut off before its usage came (two requests, or the limit here): count the stream.
            completion, reasoning = self.completion_pieces, reader.reasoning_pieces
        first = self.first_token_s
        prompt_eval_s = _seconds(timings.get("prompt_ms"))
        if prompt_eval_s is None:
            prompt_eval_s = first or total
        decode_s = _seconds(timings.get("predicted_ms"))
        if decode_s is None:
            decode_s = total - (first or total)
        prompt_details = usage.get("prompt_tokens_details")
        cached = _count(prompt_details.get("cached_tokens")) if isinstance(
            prompt_details, dict) else None  # fmt: skip
        if cached is None:
            cached = _count(timings.get("cache_n")) or 0
        prompt = _count(usage.get("prompt_tokens")) or 0
        return Stats(
            prompt_tokens=prompt,
            cached_tokens=cached,
            # What the server evaluated: its own count (llama-server's), else the prompt less
            # what it found cached.
            prompt_eval_tokens=_count(timings.get("prompt_n")) or max(0, prompt - cached),
            prompt_eval_s=round(prompt_eval_s, 4),
            completion_tokens=completion,
            reasoning_tokens=min(reasoning, completion),
            answer_tokens=max(0, completion - reasoning),
            budget_reached=policy.budget_reached,
            loop=policy.loop,
            loop_at=policy.loop_at,
            waits=policy.waits,
            thinking_unfinished=reader.unfinished
            and not policy.budget_reached
            and policy.loop != "answered",
            decode_s=round(decode_s, 4),
            first_token_s=None if first is None else round(first, 4),
            total_s=round(total, 4),
            finish_reason=self.finish if self.finish in ("length", "loop", "unsure") else "stop",
            seed=params.get("seed"),
            model=f"{engine.model} at {engine.url}",
            **self._confidence(),
            extra={"usage_reported": bool(usage),
                   **({"confidence_unavailable": f"the backend {engine.url} sent no logprobs"}
                      if self.trace is not None and not self.trace.tokens else {})},
        )  # fmt: skip

    def _confidence(self) -> dict[str, Any]:
        """The Stats fields of the answer's confidence, where its server sent logprobs."""
        if self.trace is None or not self.trace.tokens:
            return {}
        stats = self.trace.stats()
        return {"confidence": stats["confidence"],
                "lowest_group_confidence": stats["lowest_group_confidence"]}  # fmt: skip


# --- samples of one question asked together (``n``) ----------------------------------------------


class _Alone(Exception):
    """The shared request did not carry this sample (the server refused ``n``, or answered
    fewer choices): it is asked on its own."""


class _SharedRequest:
    """Samples of one question asked as one request with ``n`` (vLLM, SGLang, phi4 serve and
    the llama-server builds that take it decode the choices together, the prompt's work done
    once). One thread reads the stream and hands each choice's chunks to its sample's reader,
    which treats them as its own response; the request is hung up once no sample reads it (an
    early stop cancels them all). A sample that leaves early (a loop, a think budget, DeepConf's
    floor) is no longer handed its chunks, though the server goes on with its choice: one
    choice of a request cannot be stopped alone. What comes after its first leg (an answer
    asked for after a budget, a "Wait") it asks on its own."""

    def __init__(self, engine: RemoteEngine, params: JSON, count: int) -> None:
        import queue

        self.engine, self.params, self.count = engine, params, count
        self.queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(count)]
        self.empty = queue.Empty
        self.heard = [False] * count  # a chunk of this choice came
        self.reading = count  # members still reading
        self._lock = threading.Lock()
        self.state = _StreamState(time.monotonic())
        if _wants_confidence(params):
            self.state.trace = TraceConfidence()  # (the stream's size limit allows logprobs)
        self.attempt = Attempt()  # to hang up once nobody reads
        self.state.attempt = self.attempt

    def member(self, index: int) -> _Member:
        return _Member(self, index)

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
        body = engine._body(self.params, messages_for(self.params))
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
            with _Watch(engine, self.state) as watch:
                for chunk in engine._chunks(engine._http(), body, watch):
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
                    for choice in _choices(chunk, engine.url):
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
        except _Failure as failure:
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
                _Failure(ErrorCode.INTERNAL, f"reading the backend {engine.url} failed: {error!r}"),
            )
        if ended[0] == "end" and not self.attempt.cancelled:
            if all(self.heard):
                engine.takes_n = True
            elif self.heard[0] and not any(self.heard[1:]):
                engine.takes_n = False  # it answered one choice: n is not what it reads
        for index, each in enumerate(self.queues):
            alone = ended[0] == "end" and not self.heard[index] and not self.attempt.cancelled
            each.put(("alone", None) if alone else ended)


class _Member:
    """One sample's view of a shared request: its choice's chunks, then None at the end."""

    def __init__(self, shared: _SharedRequest, index: int) -> None:
        self.shared, self.index = shared, index

    def chunks(self, state: _StreamState) -> Iterator[dict[str, Any] | None]:
        inbox = self.shared.queues[self.index]
        try:
            while True:
                try:
                    item = inbox.get(timeout=0.1)
                except self.shared.empty:
                    if state.attempt is not None and state.attempt.cancelled:
                        return  # (the flight ended it)
                    continue
                if isinstance(item, tuple):
                    kind, error = item
                    if kind == "alone":
                        raise _Alone
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


def shared_params(members: list[JSON]) -> JSON | None:
    """The one request that asks for ``members`` together, or None when they cannot be: each
    the same but for its seed, and the seeds none or consecutive (seed, seed + 1, ...: the
    choices phi4 serve gives a request seeded ``seed``), as ``--samples`` makes them."""
    first = members[0]
    bare = [{k: v for k, v in m.items() if k != "seed"} for m in members]
    if any(b != bare[0] for b in bare[1:]):
        return None
    seeds = [m.get("seed") for m in members]
    if all(seed is None for seed in seeds):
        return first
    start = seeds[0]
    if isinstance(start, int) and seeds == list(range(start, start + len(seeds))):
        return first
    return None


# --- replicas: remote servers in a flight --------------------------------------------------------

# A replica that went away mid-run is probed this long after (seconds, one after another)
# before it is given up on for the run: about 15 s in all, time for a server to restart.
PROBE_DELAYS_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


class ReplicaInbox:
    """Where the threads of a flight's remote requests leave what their servers sent."""

    def __init__(self) -> None:
        import queue

        self._queue: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        self._empty = queue.Empty

    def put(self, delivery: Delivery) -> None:
        self._queue.put(delivery)

    def get(self, timeout: float | None) -> Delivery | None:
        try:
            return self._queue.get(timeout=timeout)
        except self._empty:
            return None


class RemoteReplica(Replica):
    """One OpenAI-compatible server in a flight: each request in flight on it is a thread
    reading its stream (httpx is blocking; a few dozen threads cost little next to a model's
    answer), and what comes goes to the flight's inbox."""

    def __init__(self, engine: RemoteEngine, window: int, inbox: ReplicaInbox) -> None:
        super().__init__(window)
        self.engine, self.inbox = engine, inbox
        self.name = engine.url
        self.attempts: dict[int, Attempt] = {}
        # Samples of one question sent in this round, by their group: asked together at flush.
        self._grouped: dict[Any, list[tuple[int, JSON, Attempt]]] = {}

    def send(self, serial: int, op: str, params: JSON) -> None:
        def busy(wait: float) -> None:
            self.inbox.put((self, serial, Slow(wait)))

        attempt = Attempt(on_busy=busy)
        attempt.floor = params.get("confidence_floor")  # (an adjust later replaces it)
        self.attempts[serial] = attempt
        group = params.get("sample_group")
        if group is not None and self.engine.takes_n is not False:
            # One of several samples of a question: sent with the others given to this server
            # in the same round, as one request with n (see flush).
            self._grouped.setdefault(group, []).append((serial, params, attempt))
            return
        self._start(serial, params, attempt, None)

    def flush(self) -> None:
        grouped, self._grouped = self._grouped, {}
        # At most MAX_SHARED choices a request (phi4 serve's and OpenAI's limit of n is 16).
        parts = [members[at : at + MAX_SHARED] for members in grouped.values()
                 for at in range(0, len(members), MAX_SHARED)]  # fmt: skip
        for members in parts:
            shared = shared_params([params for _serial, params, _attempt in members]) \
                if len(members) > 1 else None  # fmt: skip
            if shared is None:
                for serial, params, attempt in members:
                    self._start(serial, params, attempt, None)
                continue
            request = _SharedRequest(self.engine, shared, len(members))
            for index, (serial, params, attempt) in enumerate(members):
                self._start(serial, params, attempt, request.member(index))
            request.start()

    def _start(self, serial: int, params: JSON, attempt: Attempt, member: _Member | None) -> None:
        threading.Thread(target=self._read, args=(serial, params, attempt, member), daemon=True,
                         name="phi4-remote").start()  # fmt: skip

    def _read(self, serial: int, params: JSON, attempt: Attempt, member: _Member | None) -> None:
        try:
            for event in self.engine.stream(params, attempt, member):
                if attempt.cancelled:
                    return
                self.inbox.put((self, serial, event))
        except ReplicaFault as fault:
            if attempt.cancelled:
                return  # the hang-up was ours: it says nothing of the server
            self.inbox.put((self, serial, Failure(fault.code, fault.message, down=fault.down,
                                                  elsewhere=fault.elsewhere,
                                                  stats=fault.stats)))  # fmt: skip
        except Exception as error:  # a bug here must not leave the request without an end
            self.inbox.put(
                (
                    self,
                    serial,
                    Failure(
                        ErrorCode.INTERNAL,
                        f"reading the backend {self.engine.url} failed: {error!r}",
                    ),
                )
            )
        finally:
            self.attempts.pop(serial, None)

    def adjust(self, serial: int, params: JSON) -> None:
        attempt = self.attempts.get(serial)
        if attempt is not None and "confidence_floor" in params:
            attempt.floor = params["confidence_floor"]  # read by its stream's thread

    def cancel(self, serial: int) -> Event | None:
        attempt = self.attempts.pop(serial, None)
        if attempt is not None:
            attempt.cancel()
        # Hanging up is the only way to stop an OpenAI-compatible server, and it sends no end.
        return Event.error(ErrorCode.CANCELLED, "cancelled")

    def may_recover(self, failure: Failure) -> bool:
        # A server that never answered in this run and cannot be reached is not waited for:
        # a wrong URL fails at once. While others of its requests are still in flight, one
        # connection that failed says too little.
        return self.worked or failure.code != ErrorCode.UNREACHABLE or bool(self.in_flight)

    def recover(self, flight: Flight) -> None:
        failure = self.last_failure
        if failure is not None and not self.may_recover(failure):
            self.inbox.put((self, None, Probe(False, failure)))
            return

        def probe() -> None:
            reason = None
            for delay in PROBE_DELAYS_S:
                time.sleep(delay)
                if flight.closed:
                    return
                reason = self.engine.probe()
                if reason is None:
                    self.inbox.put((self, None, Probe(True)))
                    return
            gone = Failure(ErrorCode.UNREACHABLE,
                           f"the backend {self.engine.url} went away: {reason}")  # fmt: skip
            self.inbox.put((self, None, Probe(False, failure or gone)))

        threading.Thread(target=probe, daemon=True, name="phi4-probe").start()

    def close(self, idle: bool) -> None:
        for attempt in list(self.attempts.values()):
            attempt.cancel()


def probe_all(engines: list[RemoteEngine]) -> list[JSON]:
    """Each server's state now (``phi4 status --backend``): up or down, how long the probe
    took and, where the server publishes metrics, its requests in flight, waiting and answered
    and the tokens a second it generates (over :data:`LOAD_WINDOW_S`); all probed at once."""
    results: list[JSON] = [{} for _ in engines]

    def probe(i: int) -> None:
        started = time.monotonic()
        reason = engines[i].probe()
        results[i] = {"replica": engines[i].url, "state": "up" if reason is None else "down",
                      "reason": reason,
                      "probe_s": round(time.monotonic() - started, 3)}  # fmt: skip
        if reason is not None:
            return
        results[i]["models"] = engines[i].served_models()
        first = engines[i].load()
        results[i].update({key: first.get(key) for key in LOAD_METRICS})
        if "tokens" in first:
            time.sleep(LOAD_WINDOW_S)
            later = engines[i].load()
            if "tokens" in later:
                rate = max(0.0, later["tokens"] - first["tokens"]) / LOAD_WINDOW_S
                results[i]["tokens_per_s"] = round(rate, 1)
        results[i].setdefault("tokens_per_s", None)

    threads = [threading.Thread(target=probe, args=(i,), daemon=True) for i in range(len(engines))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results
