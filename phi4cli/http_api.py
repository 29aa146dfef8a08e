"""``phi4 serve --http``: the resident daemon behind an OpenAI-compatible HTTP API.

Starlette on uvicorn, over the daemon :class:`~phi4cli.backends.Backend`: each choice of an HTTP
request (``n`` of them) is one daemon request over the Unix socket, so the HTTP side keeps no model
state of its own — the daemon's slots, prefix cache and scheduling serve HTTP clients as they
serve `phi4 solve`. Which of OpenAI's fields are honoured, refused or ignored: docs/openai.md.

Each stream reads its daemon events in a worker thread and writes to its client from the event
loop, so a slow or stuck client holds up nobody else; a client that hangs up cancels its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import re
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from phi4cli.backends import Backend, RequestStream
from phi4cli.config import Settings, parse_duration, variable
from phi4cli.errors import ConfigError, Phi4Error, RequestError, UsageError, http_status_for
from phi4cli.exits import Announce
from phi4cli.http_access import AccessGuard, AccessPolicy, PeerGate, port_number
from phi4cli.options import SETTINGS, sample_seed
from phi4cli.outcome import Outcome
from phi4cli.protocol import (
    MAX_TOP_LOGPROBS,
    ErrorCode,
    Event,
    EventKind,
    Op,
    ProtocolViolation,
    Stats,
    parse_chat_params,
)
from phi4cli.records import Record

MAX_BODY_BYTES = 4 << 20


def _timeout(name: str, default: float) -> float:
    """Seconds from variable ``name`` (a number, or a duration such as 30s), ``default`` when
    unset; raise ConfigError naming it for 0, a negative, inf or NaN."""
    text = variable(name)
    if not text:
        return default
    try:
        seconds = parse_duration(text)
    except ValueError:
        seconds = 0.0
    if seconds <= 0:
        raise ConfigError(f"{name}: invalid {text[:40]!r}: expected a number of seconds above 0")
    return seconds


# A client has this long to send a request's headers, and then its body: slow clients that
# never finish (slowloris) are cut off instead of holding connections forever.
HEADER_TIMEOUT_S = _timeout("PHI4_HTTP_HEADER_TIMEOUT", 10.0)
BODY_TIMEOUT_S = _timeout("PHI4_HTTP_BODY_TIMEOUT", 30.0)
MAX_CONNECTIONS = 512
# Worker threads for streams waiting on the daemon (anyio's default of 40 would cap concurrent
# streams below the daemon's queue).
STREAM_THREADS = 128


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ApiError(Exception):
    """An HTTP error in OpenAI's shape; ``code`` is the status unless OpenAI names one
    (``model_not_found``), ``param`` the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.code, self.param = code, param

    @classmethod
    def of(cls, code: ErrorCode, message: str) -> ApiError:
        status = http_status_for(code)
        return cls(status, message, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"message": self.message, "type": self.kind,
                                 "code": self.code or self.status}  # fmt: skip
        if self.param is not None:
            error["param"] = self.param
        return {"error": error}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def unencodable_field(body: Any) -> str | None:
    """The first field of a parsed JSON body holding text that is not UTF-8-encodable (a lone
    surrogate such as ``"\\ud800"``, which JSON allows), named ``messages[0].content``; None if
    every string is text."""
    from phi4cli.inputs import find_unencodable

    found = find_unencodable(body)
    if found is None:
        return None
    path, is_key = found
    named = ""
    for step in path:
        if isinstance(step, int):
            named = f"{named}[{step}]"
        else:
            named = f"{named}.{step}" if named else step
    return f"a key of {named or 'the body'}" if is_key else named or "the body"


def check_model(body: dict[str, Any], model_name: str, served: frozenset[str]) -> None:
    """Accept a request's ``model`` that names the loaded model (its name, file name, an alias
    of its file, ``default``) or is absent; raise ApiError 404 ``model_not_found`` otherwise,
    rather than answer with another model than the one asked for."""
    requested = body.get("model")
    if requested is None or requested == "":
        return
    if not isinstance(requested, str):
        raise ApiError(400, "'model' must be a string", param="model")
    if requested.lower() not in served:
        raise ApiError(
            404,
            f"the model {requested!r} is not served here: this server serves {model_name!r} "
            "(ask for that name, or 'default')",
            code="model_not_found", param="model",
        )  # fmt: skip


# The most choices (``n``) one request may ask for: each is its own daemon request, and this
# many leaves most of the daemon's queue (64 by default) to other clients.
MAX_CHOICES = 16
MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 1_000  # each stop string's (the text held back is checked against each)

_NO_TOOLS = "this server calls no tools (no function calling)"
# Fields of OpenAI's chat-completions reference that serve does not honour: each is taken at the
# value that asks for nothing (null, or the value shown accepted here) and refused with a 400
# naming it otherwise, so that no client gets other behaviour than it asked for without a word.
_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (lambda value: value == [], _NO_TOOLS),
    "tool_choice": (lambda value: value == "none", _NO_TOOLS),
    "functions": (lambda value: value == [], _NO_TOOLS),
    "function_call": (lambda value: value == "none", _NO_TOOLS),
    "response_format": (
        lambda value: isinstance(value, dict) and value.get("type") == "text",
        "only {'type': 'text'}: JSON mode and JSON schemas are not supported",
    ),
    "logit_bias": (lambda value: value == {}, "the sampler takes no logit biases"),
    "audio": (lambda value: False, "this server answers with text only"),
    "modalities": (lambda value: value == ["text"], "this server answers with text only"),
    "prediction": (lambda value: False, "predicted outputs are not supported"),
    "web_search_options": (lambda value: False, "this server does not search the web"),
    "reasoning_effort": (
        lambda value: False,
        "the model's thinking has no effort levels here ('max_tokens' bounds it)",
    ),
    "verbosity": (lambda value: False, "the model's answer length cannot be chosen"),
}


def check_fields(body: dict[str, Any]) -> None:
    """Raise ApiError 400 naming the first field of OpenAI's reference that asks for what
    serve does not do (see ``_REFUSED``). Fields outside the reference are not read at all."""
    for name, (accepted, why) in _REFUSED.items():
        value = body.get(name)
        if value is not None and not accepted(value):
            raise ApiError(400, f"'{name}' is not supported: {why}", param=name)


def _message_text(message: Any, index: int) -> str:
    """A message's content: a string, or a list of text parts (joined); raise ApiError naming
    the part that is not text (an image, audio, a file)."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for at, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):  # fmt: skip
                raise ApiError(
                    400,
                    f"'messages[{index}].content[{at}]' is not supported: only text parts "
                    "({'type': 'text', 'text': ...}); this model reads text only",
                    param=f"messages[{index}].content[{at}]",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, "each message needs a string 'content'", param=f"messages[{index}]")


def _whole(body: dict[str, Any], name: str, low: int, high: int, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be a whole number from {low} to {high}", param=name)
    return value


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    """The request's ``stop``: none, a string, or a list of up to MAX_STOPS non-empty strings."""
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise ApiError(
            400,
            f"'stop' must be a string or a list of up to {MAX_STOPS} strings, each of 1 to "
            f"{MAX_STOP_CHARS:,} characters",
            param="stop",
        )
    return tuple(dict.fromkeys(stops))


class ChatRequest(Record):
    """An OpenAI chat request as serve answers it: one daemon request per choice."""

    params: tuple[dict[str, Any], ...]  # each choice's daemon request
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool


def read_chat_request(body: dict[str, Any], model: str, settings: Settings) -> ChatRequest:
    """Check an OpenAI chat request and make its daemon requests (ApiError if it cannot):
    ``n`` of them, each its own session and, when a seed is given, seed + i."""
    check_fields(body)
    params = chat_params(body, model, settings)
    choices = _whole(body, "n", 1, MAX_CHOICES, 1)
    stops = _stop_strings(body)
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise ApiError(400, "'stream_options' must be an object, given only with 'stream': true",
                       param="stream_options")  # fmt: skip
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ApiError(400, "'stream_options.include_usage' must be true or false",
                       param="stream_options.include_usage")  # fmt: skip
    seed = params.get("seed")
    each = tuple(
        {**params, "session": uuid.uuid4().hex if i else params["session"],
         **({"seed": sample_seed(seed, i)} if seed is not None else {})}
        for i in range(choices)
    )  # fmt: skip
    return ChatRequest(each, stops, stream, include_usage)


def _logprobs(body: dict[str, Any]) -> int | None:
    """How many likeliest tokens each answer token's ``logprobs`` entry lists, from OpenAI's
    ``logprobs`` and ``top_logprobs``; None when the request asks for no log-probabilities."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise ApiError(400, "'logprobs' must be true or false", param="logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                            or not 0 <= top <= MAX_TOP_LOGPROBS):  # fmt: skip
        raise ApiError(400, "'top_logprobs' must be a whole number from 0 to "
                       f"{MAX_TOP_LOGPROBS}", param="top_logprobs")  # fmt: skip
    if top and not asked:  # as OpenAI: top_logprobs goes with logprobs true
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if asked else None


def chat_params(body: dict[str, Any], model: str, settings: Settings) -> dict[str, Any]:
    """Turn an OpenAI chat request into a daemon ``chat`` request (ApiError if it cannot).

    The OpenAI shape (roles, system messages) is checked here; the values themselves by the
    protocol's own schema, the same check the daemon makes.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list")
    system_parts: list[str] = []
    turns: list[dict[str, str]] = []
    for index, message in enumerate(messages):
        content = _message_text(message, index)
        role = message.get("role")
        if role in ("system", "developer"):
            system_parts.append(content)
        elif role in ("user", "assistant"):
            turns.append({"role": role, "content": content})
        else:
            tools = ": this server calls no tools" if role in ("tool", "function") else ""
            raise ApiError(400, f"unsupported message role {role!r}{tools}",
                           param=f"messages[{index}].role")  # fmt: skip
    if not turns or turns[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's")
    # Read here, not by the daemon: a 1 for true, or n = 2 answered with one choice, would be
    # taken without a word.
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    logprobs = _logprobs(body)
    params: dict[str, Any] = {
        # Each request is its own session: the daemon finds the shared prefix in its slots.
        "session": uuid.uuid4().hex,
        "message": turns[-1]["content"],
        "history": turns[:-1],
        "system": "\n\n".join(system_parts) or None,
        "model": model,
    }
    # Each setting by its names on the OpenAI wire (``deterministic`` is phi4's own), checked
    # below as the daemon checks it; a refusal names the field as the request spelled it.
    field_of = {"history": "messages", "message": "messages"}
    for row in SETTINGS:
        given = [name for name in row.openai if body.get(name) is not None]
        if given:
            params[row.key] = body[given[0]]
            field_of[row.key] = given[0]
    if body.get("max_completion_tokens") is not None:  # OpenAI's newer name for max_tokens
        params["max_tokens"] = body["max_completion_tokens"]
        field_of["max_tokens"] = "max_completion_tokens"
    if logprobs is not None:
        params["logprobs"] = logprobs
    try:
        parse_chat_params(params, settings)
    except ProtocolViolation as exc:
        named = re.match(r"'([a-z_]+)'", exc.message)
        field = field_of.get(named[1], named[1]) if named else None
        message = exc.message
        if named and field != named[1]:
            message = f"'{field}'" + message[named.end() :]
        raise ApiError(400, message, param=field) from None
    return params


def _finish_reason(outcome: Outcome) -> str:
    return "length" if outcome.stats is not None and outcome.stats.length_limited else "stop"


class DaemonCollector:
    """/metrics: the daemon's counters, read from its status at scrape time."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def collect(self) -> Iterator[Metric]:
        try:
            status = self.backend.status()
        except Phi4Error:
            status = {}
        metrics = status.get("metrics") or {}
        yield GaugeMetricFamily("phi4_up", "Whether the daemon answers (1) or not (0).",
                                value=1 if status else 0)  # fmt: skip
        yield CounterMetricFamily("phi4_requests", "Requests the daemon finished.",
                                  value=metrics.get("requests", 0))  # fmt: skip
        yield GaugeMetricFamily("phi4_queue_depth", "Requests waiting for a slot.",
                                value=status.get("queued", 0))  # fmt: skip
        yield GaugeMetricFamily("phi4_requests_active", "Requests being answered.",
                                value=status.get("requests_active", 0))  # fmt: skip
        tokens = CounterMetricFamily(
            "phi4_tokens", "Tokens by kind: prompt, cached (of the prompt), completion.",
            labels=["kind"],
        )  # fmt: skip
        for kind in ("prompt", "cached", "completion"):
            tokens.add_metric([kind], metrics.get(f"{kind}_tokens", 0))
        yield tokens
        buckets = [
            (bound, count) for bound, count in (metrics.get("latency_buckets") or {}).items()
        ]
        buckets.append(("+Inf", metrics.get("requests", 0)))
        yield HistogramMetricFamily(
            "phi4_request_duration_seconds", "Time from a request's start to its end.",
            buckets=buckets, sum_value=metrics.get("latency_sum_s", 0.0),
        )  # fmt: skip
        errors = CounterMetricFamily("phi4_errors", "Requests that ended in an error, by code.",
                                     labels=["code"])  # fmt: skip
        for code, count in (metrics.get("errors") or {}).items():
            errors.add_metric([code], count)
        yield errors


def create_app(
    backend: Backend,
    settings: Settings,
    model: str,
    model_name: str,
    created: int,
    api_key: str | None,
    access: AccessPolicy,
    aliases: Iterable[str] = (),
) -> AccessGuard:
    """The ASGI application behind its access checks (tests may drive it in-process).

    ``model_name`` is what /v1/models lists; requests may name it, the file's name or stem, one
    of ``aliases`` or ``default``.
    """
    served = frozenset(
        name.lower()
        for name in (model_name, Path(model).name, Path(model).stem, "default", *aliases)
    )
    registry = CollectorRegistry()
    registry.register(DaemonCollector(backend))
    http_requests = Counter("phi4_http_requests", "HTTP requests served, by path and status.",
                            ["path", "status"], registry=registry)  # fmt: skip
    chat_choices = Counter("phi4_http_chat_choices",
                           "Choices chat completion requests asked for (n each), each a daemon "
                           "request.", registry=registry)  # fmt: skip

    def authorized(request: Request) -> bool:
        if api_key is None:
            return True
        offered = request.headers.get("authorization", "")
        return hmac.compare_digest(offered.encode(), f"Bearer {api_key}".encode())

    def route(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            try:
                if not authorized(request):
                    raise ApiError(401, "missing or wrong API key", "authentication_error")
                response: Response = await handler(request)
            except ApiError as error:
                response = error.response()
            http_requests.labels(request.url.path, str(response.status_code)).inc()
            return response

        return endpoint

    async def health(_request: Request) -> Response:
        try:
            state = (await anyio.to_thread.run_sync(backend.status)).get("state")
        except Phi4Error:
            state = "stopped"
        ready = state == "ready"
        return JSONResponse({"status": "ok" if ready else state}, status_code=200 if ready else 503)

    async def metrics(_request: Request) -> Response:
        data = await anyio.to_thread.run_sync(generate_latest, registry)
        return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(_request: Request) -> Response:
        entry = {"id": model_name, "object": "model", "created": created, "owned_by": "phi4"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def chat(request: Request) -> Response:
        # Only JSON: a browser sends text/plain, form and multipart bodies cross-site without
        # asking first (a "simple request"), so those must never start an answer.
        media, _, parameters = request.headers.get("content-type", "").partition(";")
        charset = parameters.strip().lower().removeprefix("charset=").strip('"')
        if media.strip().lower() != "application/json" or charset not in ("", "utf-8"):
            raise ApiError(
                415,
                "the body must be sent as 'Content-Type: application/json' (UTF-8), not "
                f"{request.headers.get('content-type', 'without a Content-Type')!r}",
            )
        announced = request.headers.get("content-length")
        if announced is not None and announced.isdigit() and int(announced) > MAX_BODY_BYTES:
            raise ApiError(413, "request body too large")
        raw = bytearray()
        try:
            with anyio.fail_after(BODY_TIMEOUT_S):
                async for part in request.stream():
                    raw += part
                    if len(raw) > MAX_BODY_BYTES:
                        raise ApiError(413, "request body too large")
        except TimeoutError:
            raise ApiError(
                408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s"
            ) from None
        try:
            body = json.loads(bytes(raw) or b"{}")
        except UnicodeDecodeError:
            raise ApiError(400, "the body is not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"malformed JSON: {exc}") from None
        except RecursionError:
            raise ApiError(400, "the JSON is nested too deeply") from None
        except ValueError as exc:  # an integer of more digits than Python converts (4,300)
            raise ApiError(400, f"malformed JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        bad_text = unencodable_field(body)
        if bad_text is not None:
            raise ApiError(
                400,
                f"{bad_text} holds a lone surrogate (such as \\ud800), which is not text: "
                "send UTF-8 text",
                param=bad_text,
            )
        check_model(body, model_name, served)
        chat_request = read_chat_request(body, model, settings)
        chat_choices.inc(len(chat_request.params))
        streams = [backend.stream(Op.CHAT, params) for params in chat_request.params]
        # Up to the daemon's acceptance of each: a refusal (bad request, busy) is an HTTP status.
        firsts = await asyncio.gather(*(_first_events(s) for s in streams), return_exceptions=True)
        refused: BaseException | Event | None = next(
            (f for f in firsts if isinstance(f, BaseException)), None
        )
        if refused is None:
            terminals = [f[-1] for f in firsts if isinstance(f, list) and f and f[-1].terminal]
            refused = next((t for t in terminals if t.kind == EventKind.ERROR), None)
        if refused is not None:
            for stream in streams:
                stream.close()
            if isinstance(refused, Event):
                raise ApiError.of(refused.code, refused.message)
            if isinstance(refused, RequestError):  # too long to send
                raise ApiError(413, str(refused)) from None
            if isinstance(refused, Phi4Error):
                raise ApiError(503, str(refused), "server_error") from None
            raise refused
        first = [f for f in firsts if isinstance(f, list)]
        asked = chat_request.params[0].get("logprobs") is not None
        choices = [_Choice(i, stream, chat_request.stops, asked)
                   for i, stream in enumerate(streams)]  # fmt: skip
        completion = _Completion(model_name, choices, chat_request.include_usage)
        if chat_request.stream:
            return StreamingResponse(completion.sse(first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        failed = await _unless_disconnected(request, streams, completion.fold(first))
        if failed is not None:
            assert failed.outcome.error is not None
            raise ApiError.of(failed.outcome.error.code, failed.outcome.error.message)
        return JSONResponse(completion.whole())

    async def http_error(request: Request, exc: Exception) -> Response:
        # Starlette's own 404 and 405, in the API's JSON shape.
        assert isinstance(exc, HTTPException)
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")\
            .response()  # fmt: skip

    app = Starlette(routes=[
        Route("/health", route(health), methods=["GET"]),
        Route("/metrics", route(metrics), methods=["GET"]),
        Route("/v1/models", route(models), methods=["GET"]),
        Route("/v1/chat/completions", route(chat), methods=["POST"]),
    ], exception_handlers={HTTPException: http_error})  # fmt: skip
    return AccessGuard(app, access)


async def _unless_disconnected(request: Request, streams: list[RequestStream], work: Any) -> Any:
    """Await ``work`` (a whole answer being read); a client that hangs up meanwhile has its
    requests cancelled, as a streaming one has."""
    result: Any = None
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while not await request.is_disconnected():
                await anyio.sleep(0.2)
            for stream in streams:
                stream.cancel()

        group.start_soon(watch)
        result = await work
        group.cancel_scope.cancel()
    return result


async def _next(stream: RequestStream) -> Event | None:
    """The stream's next event, read in a worker thread; None after the terminal one."""

    def read() -> Event | None:
        return next(stream, None)

    return await anyio.to_thread.run_sync(read)


async def _first_events(stream: RequestStream) -> list[Event]:
    """Read up to the request's acceptance (or its first text, or its end)."""
    events: list[Event] = []
    while (event := await _next(stream)) is not None:
        events.append(event)
        if event.kind != EventKind.PROGRESS:
            break
    return events


class StopStrings:
    """Where an answer ends: at the first of its stop strings, fed piece by piece. Text that
    could be the start of one is held back until the pieces after it say whether it is, so a
    stop string split across tokens is found as one written whole."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return the text that may be passed on now, and whether a stop string was reached
        (then that text is all of the answer before it)."""
        text = self.held + text
        found = [at for at in (text.find(stop) for stop in self.stops) if at >= 0]
        if found:
            self.held = ""
            return text[: min(found)], True
        keep = 0  # the longest end of the text that begins a stop string
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), keep, -1):
                if text.endswith(stop[:size]):
                    keep = size
                    break
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The text held back, at the answer's end (no stop string came of it)."""
        held, self.held = self.held, ""
        return held


# A delta for the client, and the logprobs entries of the tokens it carries (None: no logprobs
# asked for, or none with it).
Delta = tuple[dict[str, Any], list[dict[str, Any]] | None]


class _Choice:
    """One choice of a completion: its daemon request's events folded, its answer up to the
    first stop string, how it ended and, when asked for, its answer tokens' logprobs."""

    def __init__(self, index: int, stream: RequestStream, stops: tuple[str, ...],
                 logprobs: bool = False) -> None:  # fmt: skip
        self.index, self.stream = index, stream
        self.outcome = Outcome(index=index, question="")
        self.stops = StopStrings(stops)
        self.content = ""  # the answer as sent: up to a stop string
        self.reasoning = ""
        self.stopped = False  # a stop string was reached, and the request cancelled there
        # The answer's tokens' logprobs, as sent (None: not asked for), those not sent yet, and
        # how much of the content the sent ones' text covers.
        self.logprobs: list[dict[str, Any]] | None = [] if logprobs else None
        self._unsent: list[dict[str, Any]] = []
        self._covered = 0

    def apply(self, event: Event) -> list[Delta]:
        """Fold one event; return the deltas it makes for the client."""
        before = self.outcome.solution
        self.outcome.apply(event)
        if self.stopped:
            if event.terminal:  # the cancel's end (or any end): the answer ended at its stop
                self.outcome.error = None
            return []
        if self.logprobs is not None and event.kind == EventKind.TOKEN:
            self._unsent += event.get("logprobs") or []
        deltas: list[Delta] = []
        if event.kind == EventKind.TOKEN and event.text:
            text, self.stopped = self.stops.feed(event.text)
            if text:
                self.content += text
                deltas.append(({"content": text}, self._send()))
            if self.stopped:
                self.stream.cancel()  # the events go on to its end, with its stats
        elif event.kind == EventKind.REASONING and event.text:
            self.reasoning += event.text
            deltas.append(({"reasoning_content": event.text}, None))
        elif event.kind == EventKind.RETRACT and before:
            # Text sent as answer was thinking after all (a model that closed a <think> it
            # never opened): send it again as reasoning, so that is complete.
            self.stops.flush()
            self.content = ""
            self.reasoning += before
            if self.logprobs is not None:  # they were the thinking's tokens
                self.logprobs, self._unsent, self._covered = [], [], 0
            deltas.append(({"reasoning_content": before}, None))
        elif event.kind == EventKind.DONE:
            rest = self.stops.flush()
            self.content += rest
            if rest or self._unsent:
                deltas.append(({"content": rest}, self._send()))
        return deltas

    def _send(self) -> list[dict[str, Any]] | None:
        """The logprobs entries to send with the content sent so far: all those waiting, or
        after a stop string only those whose text begins before it."""
        if self.logprobs is None or not self._unsent:
            return None
        sent: list[dict[str, Any]] = []
        for entry in self._unsent:
            if self.stopped and self._covered >= len(self.content):
                break
            sent.append(entry)
            self._covered += len(entry.get("token", ""))
        self._unsent = []
        self.logprobs += sent
        return sent or None

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped else _finish_reason(self.outcome)

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        return message


def _logprobs_of(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A choice's (or a chunk's) ``logprobs`` object, as OpenAI writes it."""
    return None if entries is None else {"content": entries, "refusal": None}


def _usage(choices: list[_Choice]) -> dict[str, Any]:
    """The completion's usage, counted as OpenAI and vLLM count ``n`` choices: the prompt once,
    the completions' tokens summed; cached: the prompt's tokens every choice found cached."""
    stats: list[Stats] = [c.outcome.stats for c in choices if c.outcome.stats is not None]
    prompt = stats[0].prompt_tokens if stats else 0
    completion = sum(s.completion_tokens for s in stats)
    cached = min((s.cached_tokens for s in stats), default=0)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def _close_when_read(future: asyncio.Future[Event | None], stream: RequestStream) -> None:
    """Close ``stream`` once the read in flight on it returns (never while a thread reads it)."""

    def close(done: asyncio.Future[Event | None]) -> None:
        if not done.cancelled():
            done.exception()  # (retrieved: a daemon gone as the client hung up is no news)
        stream.close()

    future.add_done_callback(close)


async def _events(
    choices: list[_Choice], first: list[list[Event]]
) -> AsyncGenerator[tuple[_Choice, Event]]:
    """Each choice's events as they come, interleaved, beginning with those already read; the
    caller folds each before asking for the next. A choice whose daemon went away, or whose
    events ended early, ends with an error event. Leaving early cancels the requests still
    running and closes their streams as their reads in flight return."""
    reads: dict[asyncio.Future[Event | None], _Choice] = {}

    def read(choice: _Choice) -> None:
        reads[asyncio.ensure_future(_next(choice.stream))] = choice

    try:
        for choice, events in zip(choices, first, strict=True):
            for event in events:
                yield choice, event
        for choice in choices:
            if not choice.outcome.done:
                read(choice)
        while reads:
            finished, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(finished, key=lambda f: reads[f].index):
                choice = reads.pop(future)
                try:
                    read_event = future.result()
                except Phi4Error as exc:
                    read_event = Event.error(
                        ErrorCode.INTERNAL, f"the daemon went away mid-answer: {exc}"
                    )
                if read_event is None:
                    read_event = Event.error(ErrorCode.INTERNAL, "the daemon's answer ended early")
                yield choice, read_event
                if not choice.outcome.done:
                    read(choice)
    finally:
        for future, choice in reads.items():
            choice.stream.cancel()
            _close_when_read(future, choice.stream)
        for choice in choices:
            if choice not in reads.values():
                choice.stream.close()


class _Completion:
    """One chat completion's answer, whole or as chunks: its choices interleaved."""

    def __init__(self, model_name: str, choices: list[_Choice], include_usage: bool) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model_name = model_name
        self.choices = choices
        self.include_usage = include_usage

    async def fold(self, first: list[list[Event]]) -> _Choice | None:
        """Read every choice to its end; return the first that failed (None if none did)."""
        async with contextlib.aclosing(_events(self.choices, first)) as events:
            async for choice, event in events:
                choice.apply(event)
                if choice.outcome.error is not None:
                    return choice
        return None

    def whole(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "chat.completion", "created": self.created,
            "model": self.model_name,
            "choices": [{"index": c.index, "message": c.message(),
                         "logprobs": _logprobs_of(c.logprobs),
                         "finish_reason": c.finish_reason} for c in self.choices],
            "usage": _usage(self.choices),
        }  # fmt: skip

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        chunk: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk",
                                 "created": self.created, "model": self.model_name,
                                 "choices": choices}  # fmt: skip
        if self.include_usage:  # as OpenAI: null on every chunk but the last
            chunk["usage"] = usage
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def _delta(self, index: int, delta: dict[str, Any], finish: str | None = None,
               logprobs: list[dict[str, Any]] | None = None) -> bytes:  # fmt: skip
        return self._chunk([{"index": index, "delta": delta, "logprobs": _logprobs_of(logprobs),
                             "finish_reason": finish}])  # fmt: skip

    async def sse(self, first: list[list[Event]]) -> AsyncIterator[bytes]:
        """The answer as server-sent events, each choice's chunks carrying its ``index``. An
        error after the stream began (the daemon stopped or died, the request was cancelled)
        is sent as an ``error`` object, and the stream ends without ``[DONE]``, as OpenAI's own
        API does; hanging up cancels the requests."""
        for choice in self.choices:
            yield self._delta(choice.index, {"role": "assistant", "content": ""})
        failed: _Choice | None = None
        async with contextlib.aclosing(_events(self.choices, first)) as events:
            async for choice, event in events:
                for delta, logprobs in choice.apply(event):
                    yield self._delta(choice.index, delta, logprobs=logprobs)
                if choice.outcome.error is not None:
                    failed = choice
                    break
                if event.terminal:
                    yield self._delta(choice.index, {}, choice.finish_reason)
        if failed is not None:
            assert failed.outcome.error is not None
            error = ApiError.of(failed.outcome.error.code, failed.outcome.error.message)
            yield b"data: " + json.dumps(error.body()).encode() + b"\n\n"
            return
        if self.include_usage:
            yield self._chunk([], _usage(self.choices))
        yield b"data: [DONE]\n\n"


def _header_deadline_protocol(gate: PeerGate) -> type[Any]:
    """uvicorn's h11 protocol, with a deadline for each request's headers (uvicorn has none:
    a client sending a header line a minute holds its connection forever), and each peer's
    connections counted by ``gate`` as they are accepted (one past its cap is closed then)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _peer: tuple[str, object] | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._peer = gate.admit(self.client, self.server)
            if self._peer is None:
                transport.close()  # (connection_lost takes it out of the server's count)
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state == h11.IDLE:
                if self._deadline is None:  # a request begun, its headers not all here
                    self._arm()
            elif self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            if self._peer is not None:
                gate.release(self._peer)
                self._peer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._expire)

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state == h11.IDLE:
                self.transport.close()

    return HeaderDeadline


def _sendable(api_key: str) -> bool:
    """Whether a client can send ``Bearer KEY``: not empty, ASCII (header bytes are read as
    Latin-1), printable (h11 refuses control characters), no spaces at its ends (stripped)."""
    return api_key == api_key.strip() != "" and api_key.isascii() and api_key.isprintable()


def check_address(address: str, api_key: str | None) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); raise UsageError for a bad one, a public one without a
    key, or a key no client can send."""
    if api_key is not None and not _sendable(api_key):
        raise UsageError(
            "--api-key (or PHI4_API_KEY) is empty or holds what no client can send in a header; "
            "give a key of printable ASCII characters, or no --api-key"
        )
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    port = port_number(port_text)
    if port is None:
        raise UsageError(
            f"bad address {address[:64]!r}: use HOST:PORT with a port up to 65535, e.g. "
            "127.0.0.1:8080"
        )
    if not is_loopback(host) and not api_key:
        raise UsageError(f"binding {host} (not loopback) needs --api-key")
    return host, port


def serve(
    backend: Backend,
    settings: Settings,
    model_path: Path,
    model_name: str,
    address: str,
    api_key: str | None,
    announce: Announce,
    allow_hosts: Iterable[str] = (),
    allow_origins: Iterable[str] = (),
    any_local_user: bool = False,
    aliases: Iterable[str] = (),
) -> None:
    """Serve until interrupted. Raise UsageError for a bad address or a public bind without key.

    Without a key, only the owner's uid is answered unless ``any_local_user``.
    """
    import uvicorn

    host, port = check_address(address, api_key)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)  # a bad host name is a gaierror with no strerror
        raise UsageError(f"cannot listen on {address}: {reason}") from None
    backend.connect()  # start the daemon and its model load now
    created = int(model_path.stat().st_mtime)
    bound_host, bound_port = sock.getsockname()[:2]
    access = AccessPolicy.create(
        (host, bound_host),
        allow_hosts,
        allow_origins,
        owner_only=not api_key and not any_local_user,
    )
    app = create_app(backend, settings, str(model_path), model_name, created, api_key, access,
                     aliases)  # fmt: skip
    shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=5,
                            http=_header_deadline_protocol(PeerGate(access.owner_uid is not None)),
                            limit_concurrency=MAX_CONNECTIONS)  # fmt: skip
    server = uvicorn.Server(config)
    announce(f"serving the OpenAI API on http://{shown}:{bound_port}/v1 (Ctrl-C stops)")

    async def run() -> None:
        anyio.to_thread.current_default_thread_limiter().total_tokens = STREAM_THREADS
        await server.serve(sockets=[sock])

    try:
        anyio.run(run)
    finally:
        sock.close()
        backend.close()
