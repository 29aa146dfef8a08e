"""``phi4 serve --http``: the resident daemon behind an OpenAI-compatible HTTP API.

Starlette on uvicorn, over the daemon :class:`~phi4cli.backends.backend.Backend`: each choice of an
HTTP request (``n`` of them) is one daemon request over the Unix socket, so the HTTP side keeps no
model state of its own — the daemon's slots, prefix cache and scheduling serve HTTP clients as they
serve `phi4 solve`. Which of OpenAI's fields are honoured, refused or ignored: docs/openai.md.

Each stream reads its daemon events in a worker thread and writes to its client from the event
loop, so a slow or stuck client holds up nobody else; a client that hangs up cancels its request.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import ipaddress
import json
import socket
from collections.abc import Callable, Iterable, Iterator
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

from phi4cli.backends.backend import Backend, RequestStream
from phi4cli.backends.dispatch import Announce
from phi4cli.core.config import Settings, parse_duration, variable
from phi4cli.core.errors import ConfigError, ErrorCode, Phi4Error, RequestError, UsageError
from phi4cli.core.protocol import (
    Event,
    EventKind,
    Op,
)
from phi4cli.serve.http_access import AccessGuard, AccessPolicy, PeerGate, port_number
from phi4cli.serve.openai_request import (
    ApiError,
    check_model,
    read_chat_request,
    unencodable_field,
    without_paths,
)
from phi4cli.serve.openai_response import Choice, Completion, close_when_read, next_event
from phi4cli.text.checker import Checker

MAX_BODY_BYTES = 4 << 20
# How long a streamed answer's headers wait for the daemon to admit its request (or to write
# its first text, or to refuse it): a refusal in that time is an HTTP status. Text is never
# held back by it.
ADMIT_WAIT_S = 2.0


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
        yield GaugeMetricFamily(
            "phi4_up", "Whether the daemon answers (1) or not (0).", value=1 if status else 0
        )
        yield CounterMetricFamily(
            "phi4_requests", "Requests the daemon finished.", value=metrics.get("requests", 0)
        )
        yield GaugeMetricFamily(
            "phi4_queue_depth", "Requests waiting for a slot.", value=status.get("queued", 0)
        )
        yield GaugeMetricFamily(
            "phi4_requests_active",
            "Requests being answered.",
            value=status.get("requests_active", 0),
        )
        tokens = CounterMetricFamily(
            "phi4_tokens",
            "Tokens by kind: prompt, cached (of the prompt), completion.",
            labels=["kind"],
        )
        for kind in ("prompt", "cached", "completion"):
            tokens.add_metric([kind], metrics.get(f"{kind}_tokens", 0))
        yield tokens
        buckets = [
            (bound, count) for bound, count in (metrics.get("latency_buckets") or {}).items()
        ]
        buckets.append(("+Inf", metrics.get("requests", 0)))
        yield HistogramMetricFamily(
            "phi4_request_duration_seconds",
            "Time from a request's start to its end.",
            buckets=buckets,
            sum_value=metrics.get("latency_sum_s", 0.0),
        )
        kept = (status.get("memory") or {}).get("prompt_cache") or {}
        yield GaugeMetricFamily(
            "phi4_prompt_cache_bytes", "Bytes of prompts kept in RAM.", value=kept.get("bytes", 0)
        )
        yield GaugeMetricFamily(
            "phi4_prompt_cache_prompts", "Prompts kept in RAM.", value=kept.get("prompts", 0)
        )
        yield CounterMetricFamily(
            "phi4_prompt_cache_hits",
            "Prompts put back from RAM rather than read again.",
            value=kept.get("hits", 0),
        )
        speculation = (status.get("memory") or {}).get("speculation") or {}
        yield CounterMetricFamily(
            "phi4_draft_tokens",
            "Drafted tokens verified (speculation).",
            value=speculation.get("draft_tokens", 0),
        )
        yield CounterMetricFamily(
            "phi4_draft_accepted",
            "Drafted tokens kept (speculation).",
            value=speculation.get("draft_accepted", 0),
        )
        errors = CounterMetricFamily(
            "phi4_errors", "Requests that ended in an error, by code.", labels=["code"]
        )
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
    # One checker for the server's answers (checks run one at a time, each a second at most).
    checker = None if settings.check == "off" else Checker()
    registry = CollectorRegistry()
    registry.register(DaemonCollector(backend))
    http_requests = Counter(
        "phi4_http_requests",
        "HTTP requests served, by path and status.",
        ["path", "status"],
        registry=registry,
    )
    chat_choices = Counter(
        "phi4_http_chat_choices",
        "Choices chat completion requests asked for (n each), each a daemon request.",
        registry=registry,
    )

    def authorized(request: Request) -> bool:
        if api_key is None:
            return True
        offered = request.headers.get("authorization", "")
        return hmac.compare_digest(offered.encode(), f"Bearer {api_key}".encode())

    def route(
        handler: Callable[[Request], Any], path: str | None = None
    ) -> Callable[[Request], Any]:
        """``handler`` behind the API key, its errors in the API's shape, counted by ``path``
        (the request's own unless given: a path that holds a client's words is counted under
        its template, so that no client can grow the metrics without bound)."""

        async def endpoint(request: Request) -> Response:
            try:
                if not authorized(request):
                    raise ApiError(401, "missing or wrong API key", "authentication_error")
                response: Response = await handler(request)
            except ApiError as error:
                response = error.response()
            http_requests.labels(path or request.url.path, str(response.status_code)).inc()
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

    entry = {"id": model_name, "object": "model", "created": created, "owned_by": "phi4"}

    async def models(_request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [entry]})

    async def one_model(request: Request) -> Response:
        # `client.models.retrieve(name)`: the served model under any name a request may use.
        # No name (`/v1/models/`) names no model: a chat request's absent model is the served
        # one, but this asks for one by its name.
        model_id = request.path_params["model_id"]
        if not model_id:
            raise ApiError(
                404,
                "no model named: ask for /v1/models/NAME, or /v1/models for the list",
                code="model_not_found",
                param="model",
            )
        check_model({"model": model_id}, model_name, served)
        return JSONResponse(entry)

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
        # The daemon counts a request's choices, each a daemon request of its own, against the
        # share of the HTTP connection that asked: one client, as a command's connection is.
        share = "http " + (
            f"{request.client.host}:{request.client.port}" if request.client is not None else "?"
        )
        streams = [
            backend.stream(Op.CHAT, params._replace(share=share)) for params in chat_request.params
        ]
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
                raise ApiError.of(refused)
            if isinstance(refused, RequestError):  # too long to send
                raise ApiError(413, str(refused)) from None
            if isinstance(refused, Phi4Error):
                raise ApiError(503, without_paths(str(refused)), "server_error") from None
            raise refused
        first = [f for f in firsts if isinstance(f, list)]
        pending: dict[int, asyncio.Future[list[Event]]] = {}
        if chat_request.stream:
            # Refused at admission (a prompt too long for the context): a status, as when not
            # streamed, rather than an error event after a 200.
            pending = await _past_admission(streams, first)
            ends = [events[-1] for events in first if events]
            refused_late = next((end for end in ends if end.kind == EventKind.ERROR), None)
            if refused_late is not None:
                for index, stream in enumerate(streams):
                    read = pending.get(index)
                    if read is None:
                        stream.close()
                    else:
                        stream.cancel()
                        close_when_read(read, stream)
                raise ApiError.of(refused_late)
        asked = chat_request.params[0].logprobs is not None
        choices = [
            Choice(i, stream, chat_request.stops, asked, chat_request.stream)
            for i, stream in enumerate(streams)
        ]
        completion = Completion(
            model_name, choices, chat_request.include_usage, checker, chat_request.params[0].prompt
        )
        if chat_request.stream:
            return StreamingResponse(
                completion.sse(first, pending),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        failed = await _unless_disconnected(request, streams, completion.fold(first))
        if failed is not None:
            assert failed.outcome.error is not None
            raise ApiError.of(failed.outcome.error)
        await completion.check_all()
        return JSONResponse(completion.whole())

    async def http_error(request: Request, exc: Exception) -> Response:
        # Starlette's own 404 and 405, in the API's JSON shape.
        assert isinstance(exc, HTTPException)
        return ApiError(
            exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"
        ).response()

    app = Starlette(
        routes=[
            Route("/health", route(health), methods=["GET"]),
            Route("/metrics", route(metrics), methods=["GET"]),
            Route("/v1/models", route(models), methods=["GET"]),
            Route(
                "/v1/models/{model_id:path}", route(one_model, "/v1/models/{id}"), methods=["GET"]
            ),
            Route("/v1/chat/completions", route(chat), methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error},
    )
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


async def _past_admission(
    streams: list[RequestStream], first: list[list[Event]]
) -> dict[int, asyncio.Future[list[Event]]]:
    """Read on past each accepted request's acceptance, up to its first text or its end, for
    up to ADMIT_WAIT_S: the daemon refuses a prompt too long for the context when it admits
    the request, moments after accepting it when it is idle. What came is added to ``first``;
    the reads still in flight are returned, by choice, for the stream to take over. No text
    is held back by this: it goes out as soon as it comes either way."""
    reads = {
        index: asyncio.ensure_future(_first_events(stream))
        for index, stream in enumerate(streams)
        if not (first[index] and first[index][-1].terminal)
    }
    if reads:  # (the choices share one prompt: the first of them to be admitted or refused
        # says it for all, and the text of one is not held back for another's)
        await asyncio.wait(
            reads.values(), timeout=ADMIT_WAIT_S, return_when=asyncio.FIRST_COMPLETED
        )
    pending: dict[int, asyncio.Future[list[Event]]] = {}
    for index, read in reads.items():
        if not read.done():
            pending[index] = read
            continue
        try:
            first[index].extend(read.result())
        except Phi4Error as exc:
            first[index].append(
                Event.error(
                    ErrorCode.INTERNAL,
                    f"the daemon went away mid-answer: {without_paths(str(exc))}",
                )
            )
    return pending


async def _first_events(stream: RequestStream) -> list[Event]:
    """Read up to the request's acceptance (or its first text, or its end)."""
    events: list[Event] = []
    while (event := await next_event(stream)) is not None:
        events.append(event)
        if event.kind != EventKind.PROGRESS:
            break
    return events


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
        if exc.errno == errno.EADDRINUSE:
            reason += " (another server listens there: give another port, --http HOST:PORT)"
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
    app = create_app(
        backend, settings, str(model_path), model_name, created, api_key, access, aliases
    )
    shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
        http=_header_deadline_protocol(PeerGate(access.owner_uid is not None)),
        limit_concurrency=MAX_CONNECTIONS,
    )
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
