"""The wire of a remote server: the bounds of one request's responses (time to the status line,
silence between events, the whole request's deadline, sizes) kept by a guard that hangs up,
and the checks of what a server sends (a chunk, its choices, a delta; an error answer, a
Retry-After; usage numbers worth believing). What a stream means — thinking, answer, the
policy — is ``remote.py``'s."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from email.utils import parsedate_to_datetime
from typing import Any, Protocol, cast

import httpx2 as httpx

from phi4cli.core.errors import DaemonUnavailableError
from phi4cli.core.protocol import ErrorCode


class AskAlone(Exception):
    """A request's first leg was to come as one choice of a shared request (``n``), which did
    not carry it (the server refused ``n``, or answered fewer choices): it is asked on its own."""


class Endpoint(Protocol):
    """What a Watch needs of a server: its address and its time limits."""

    url: str
    timeout: float
    deadline: float


class Server(Endpoint, Protocol):
    """What asking a server needs of its ``remote.RemoteServer``: where to post, whether
    it still asks for logprobs, and where to say a wait."""

    @property
    def endpoint(self) -> str: ...

    gives_logprobs: bool
    retry_told: bool
    notice: Callable[[str], None] | None


class WatchedState(Protocol):
    """What a Watch needs of a request's state: when it began, its connection (the guard's to
    hang up), whether it asked for logprobs (its size limit), and the flight's hold on it."""

    started: float
    socket: socket.socket | None
    trace: Any
    attempt: Any


ERROR_BODY_LIMIT = 64 * 1024  # bytes of an error answer read before the connection is closed
EXCERPT_CHARS = 200  # of a server's message, shown on one line
MAX_EVENT_BYTES = 1024 * 1024  # one server-sent event (a line that never ends included)
MAX_RETRIES = 3  # of a 429 or 503 answer
MAX_RETRY_WAIT_S = 60.0  # a longer Retry-After is not waited for
MAX_STREAM_BYTES = 64 * 1024 * 1024  # one response stream in all
RETRY_BACKOFF_S = 0.5  # the first wait when the server gives no Retry-After; doubled each time
MAX_COUNT = 10**9  # a token count above this, as a NaN or a negative one, is not believed
CODE_FOR_STATUS = {
    400: ErrorCode.BAD_REQUEST,
    404: ErrorCode.BAD_REQUEST,
    413: ErrorCode.BAD_REQUEST,
    429: ErrorCode.BUSY,
    503: ErrorCode.SHUTTING_DOWN,
    504: ErrorCode.TIMEOUT,
}


class StreamFailure(Exception):
    """The stream ended in an error: the terminal event to report. ``fault``: the server
    failed, not the request ("down": it went away, hung up or went quiet mid-answer; "busy": it
    stayed busy; "broken": it is up but answered 500 or a stream that cannot be read), so
    another replica, or the same one once it is back, may answer it."""

    def __init__(self, code: ErrorCode, message: str, fault: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.fault = code, message, fault


def transport_failure(error: httpx.TransportError, watch: Watch) -> Exception:
    """What to report for an error of the connection: unreachable (exit 3) when no answer began,
    else why the stream ended: the guard's reason when it hung up, silence, or the break."""
    if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
        return DaemonUnavailableError(f"cannot reach the backend {watch.url}: {reason(error)}")
    if watch.alarm is not None:
        return watch.alarm
    if isinstance(error, httpx.TimeoutException):
        return watch.silent() if watch.answered else watch.unanswered()
    if isinstance(error, httpx.SSEError):
        return StreamFailure(
            ErrorCode.BACKEND_ERROR, f"the backend's reply is not a stream: {error}", fault="broken"
        )
    return StreamFailure(
        ErrorCode.BACKEND_ERROR,
        f"the connection to the backend broke: {reason(error)}",
        fault="down",
    )


class Watch:
    """The time and size limits of one request's responses. Sizes and the time between events
    are checked as each piece arrives (httpx's read timeout only sees a silent socket, not one
    that trickles a byte at a time); a guard thread hangs up the connection when the answer's
    status line is not in within ``timeout`` of asking, or the whole request passes its
    ``deadline``, since a read that trickles or waits cannot check the clock itself.

    Use as a context manager: the guard runs inside it.
    """

    def __init__(self, server: Endpoint, state: WatchedState) -> None:
        self.url, self.timeout, self.deadline = server.url, server.timeout, server.deadline
        self.started = state.started  # the deadline counts from the request's start
        self.asked = time.monotonic()  # when the latest attempt was sent
        self.last_event = self.asked
        self.received = 0
        self.event_size = 0  # characters of the latest event's data (a shared reader's weight)
        self.answered = False  # the latest attempt got a status line: the server is there
        self.finished = False  # a finish_reason came: the answer is whole, whatever follows
        self.alarm: Exception | None = None  # why the guard hung up, when it did
        self.state = state
        self._done = threading.Event()
        self._guard = threading.Thread(
            target=self._hang_up_when_due, daemon=True, name="phi4-backend-guard"
        )

    def __enter__(self) -> Watch:
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

    def silent(self) -> StreamFailure:
        return StreamFailure(
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

    def too_long(self) -> StreamFailure:
        return StreamFailure(
            ErrorCode.TIMEOUT,
            f"the backend {self.url} took more than {self.deadline:g} s in all "
            "(PHI4_BACKEND_DEADLINE sets how long a request may take)",
        )

    def check(self, size: int) -> None:
        """Count ``size`` more bytes; raise StreamFailure past a limit."""
        now = time.monotonic()
        self.received += size
        if now - self.started > self.deadline:
            raise self.too_long()
        if now - self.last_event > self.timeout:
            raise self.silent()  # bytes came, but no whole event: a trickle is silence too
        # Asked for logprobs, a server sends about 1 KiB more per token.
        limit = MAX_STREAM_BYTES * (8 if self.state.trace is not None else 1)
        if self.received > limit:
            raise StreamFailure(
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


class WatchedResponse:
    """What httpx's EventSource reads of a response, with each piece of text checked by a
    Watch first, so the SSE parsing stays httpx's."""

    def __init__(self, response: httpx.Response, watch: Watch) -> None:
        self._response, self._watch = response, watch
        self.headers, self.request = response.headers, response.request

    def iter_text(self) -> Iterator[str]:
        for text in self._response.iter_text():
            self._watch.check(len(text))
            yield text


def read_bounded(response: httpx.Response, watch: Watch) -> tuple[str, bool]:
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


def retry_wait(response: httpx.Response, attempt: int) -> float | None:
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


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """``text`` as one short line: escape sequences and bidi controls cleaned as everywhere
    (one visible U+FFFD each, see phi4cli.text.sanitize), other control and format characters become
    spaces, runs of whitespace one space, and beyond ``limit`` it is cut."""
    from phi4cli.text.sanitize import clean_text

    cleaned = "".join(
        " " if unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp") else char
        for char in clean_text(text[: limit * 4])
    )
    line = " ".join(cleaned.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def nonsense(url: str, what: str) -> StreamFailure:
    return StreamFailure(ErrorCode.BACKEND_ERROR, f"the backend {url} sent {what}", fault="broken")


def reason(error: Exception) -> str:
    cause = error.__cause__ or error.__context__
    text = str(error) or (str(cause) if cause else type(error).__name__)
    if isinstance(error, httpx.ConnectTimeout):
        text = "it did not take the connection in time"
    return excerpt(text.removeprefix("[Errno 111] "))  # it may quote what the server sent


def parse_chunk(data: str, url: str) -> dict[str, Any]:
    """One streamed chunk; a malformed one, or one that carries an error, ends the stream."""
    try:
        chunk = json.loads(data)
    except (ValueError, RecursionError):  # also digits past int's limit, or nesting too deep
        shown = excerpt(data, 80)
        malformed = f"the backend sent a malformed event: {shown!r}"
        raise StreamFailure(ErrorCode.BACKEND_ERROR, malformed, "broken") from None
    if not isinstance(chunk, dict):
        raise StreamFailure(
            ErrorCode.BACKEND_ERROR, "the backend sent an event that is not an object", "broken"
        )
    error = chunk.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else error
        status = error.get("code") if isinstance(error, dict) else None
        code = CODE_FOR_STATUS.get(status if type(status) is int else 0, ErrorCode.BACKEND_ERROR)
        shown = excerpt(message if isinstance(message, str) else json.dumps(message)[:1000])
        raise StreamFailure(code, f"the backend reported an error mid-answer: {shown}")
    return chunk


def choices_of(chunk: dict[str, Any], url: str) -> list[dict[str, Any]]:
    choices = chunk.get("choices")
    if choices is None:
        return []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise nonsense(url, "'choices' that are not a list of objects")
    return choices


def delta_of(choice: dict[str, Any], url: str) -> dict[str, Any]:
    delta = choice.get("delta")
    if delta is None:
        return {}
    if not isinstance(delta, dict):
        raise nonsense(url, "a 'delta' that is not an object")
    for key in ("content", "reasoning_content", "reasoning"):
        if delta.get(key) is not None and not isinstance(delta[key], str):
            raise nonsense(url, f"a '{key}' that is not text")
    return delta


def http_failure(response: httpx.Response, text: str, whole: bool) -> StreamFailure:
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
    code = CODE_FOR_STATUS.get(status, ErrorCode.BACKEND_ERROR)
    # Busy for good (429, 503): another replica may have room. A proxy's 502 or 504 (LiteLLM's
    # for an upstream that died, say): that server failed, not the request. A 500 (or another
    # 5xx): the server is up but broken; another replica may answer, and when none does, it is
    # the request's error.
    fault = (
        "busy"
        if status in (429, 503)
        else "down"
        if status in (502, 504)
        else "broken"
        if status >= 500
        else None
    )
    return StreamFailure(code, f"the backend answered {status}: {shown}", fault)


def count_of(value: Any) -> int | None:
    """A token count the server reported, or None when it is not a believable one."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if type(value) is int and 0 <= value <= MAX_COUNT:
        return value
    return None


def seconds_of(millis: Any) -> float | None:
    """Seconds from a reported number of milliseconds, or None when it is not a believable one."""
    if type(millis) in (int, float) and math.isfinite(millis) and 0 <= millis <= 1e10:
        return float(millis) / 1000.0
    return None


@contextmanager
def opened(
    server: Server, client: httpx.Client, body: dict[str, Any], watch: Watch
) -> Iterator[httpx.Response]:
    """The response to ``body`` once the server accepts it: a 429 or 503 is asked again, up
    to MAX_RETRIES times, after its Retry-After (or a short backoff). Raise StreamFailure for a
    refusal, with a short excerpt of the server's message. A refusal of the logprobs asked
    for is asked again at once without them, as an attempt of its own (it can happen once)."""
    attempts = iter(range(MAX_RETRIES + 1))
    attempt = next(attempts)
    while True:
        watch.ask()
        with client.stream(
            "POST", server.endpoint, json=body, extensions={"trace": watch.trace}
        ) as response:
            watch.answered = True
            watch.last_event = time.monotonic()
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                # Not asked for, and a few KiB of it can inflate to gigabytes in one read.
                shown = excerpt(encoding, 40)
                raise StreamFailure(
                    ErrorCode.BACKEND_ERROR,
                    f"the backend {server.url} sent a compressed answer ({shown}), "
                    "which phi4 did not ask for",
                )
            if response.status_code < 400:
                stream = response.extensions.get("network_stream")
                if stream is not None:
                    # The connection this answer came on (from the pool, the trace saw no
                    # connect): the one a cancel or the guard hangs up.
                    watch.state.socket = stream.get_extra_info("socket")
                yield response
                return
            text, whole = read_bounded(response, watch)
            wait = retry_wait(response, attempt)
        failure = http_failure(response, text, whole)
        if (
            body.get("logprobs")
            and response.status_code in (400, 422)
            and "logprob" in failure.message.lower()
        ):
            # A server that gives no logprobs (or not 20): asked again without, and never
            # again for them; the answers then have no confidence.
            told, server.gives_logprobs = not server.gives_logprobs, False
            body = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
            if server.notice is not None and not told:
                server.notice(
                    f"the backend {server.url} gives no logprobs ({failure.message}); "
                    "answers have no confidence"
                )
            continue  # (the same attempt number: a busy server's retries are not spent)
        if (
            wait is not None
            and watch.state.attempt is not None
            and watch.state.attempt.on_busy is not None
        ):
            watch.state.attempt.on_busy(wait)  # the flight sends less to this server now
        left = server.deadline - (time.monotonic() - watch.started)
        if wait is None or attempt == MAX_RETRIES or wait > min(MAX_RETRY_WAIT_S, left):
            raise failure
        if server.notice is not None and not server.retry_told:
            server.retry_told = True  # once per command, however many waits follow
            server.notice(
                f"the backend {server.url} is busy ({response.status_code}); "
                f"asking again in {wait:g} s (up to {MAX_RETRIES} times)"
            )
        time.sleep(wait)
        attempt = next(attempts)


def response_chunks(
    server: Server, client: httpx.Client, body: dict[str, Any], watch: Watch
) -> Iterator[dict[str, Any] | None]:
    """The chunks of the response to ``body``, parsed, then None for its ``[DONE]``; a
    failure of the server or of the connection is raised as StreamFailure (or
    DaemonUnavailableError: it was never reached)."""
    done = False
    try:
        with opened(server, client, body, watch) as response:
            watched = cast(httpx.Response, WatchedResponse(response, watch))
            for sse in httpx.EventSource(watched, max_event_size=MAX_EVENT_BYTES):
                watch.last_event = time.monotonic()
                watch.event_size = len(sse.data)
                if sse.data.strip() == "[DONE]":
                    done = True
                    yield None
                    return
                yield parse_chunk(sse.data, server.url)
    except httpx.TransportError as error:  # timeouts, broken connections, bad streams
        if watch.finished and not isinstance(error, httpx.SSEError):
            # The answer ended, then the server went quiet or hung up instead of sending
            # [DONE]: its usage is lost, not the answer.
            return
        raise transport_failure(error, watch) from None
    except (httpx.RequestError, httpx.InvalidURL) as error:  # a body it cannot decode, ...
        if watch.alarm is not None:
            raise watch.alarm from None
        raise StreamFailure(
            ErrorCode.BACKEND_ERROR, f"the backend's reply cannot be read: {reason(error)}"
        ) from None
    if not done and not watch.finished:
        if watch.alarm is not None:
            raise watch.alarm
        raise StreamFailure(
            ErrorCode.BACKEND_ERROR,
            "the backend closed the stream before the answer was complete",
            fault="down",
        )
