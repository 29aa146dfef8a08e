"""``phi4 serve --http``: the resident daemon behind an OpenAI-compatible HTTP API.

Standard library only (http.server, one thread per request). Every HTTP request is one daemon
request over the Unix socket, so the HTTP side keeps no model state of its own: the daemon's
slots, prefix cache and scheduling serve HTTP clients as they serve `phi4 solve`.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from phi4cli import protocol
from phi4cli.client import connect_checked, daemon_status
from phi4cli.config import Settings
from phi4cli.errors import DaemonUnavailableError, Phi4Error, UsageError
from phi4cli.paths import Paths

MAX_BODY_BYTES = 4 << 20
_HTTP_STATUS_FOR = {
    protocol.BAD_REQUEST: HTTPStatus.BAD_REQUEST,
    protocol.CONTEXT_OVERFLOW: HTTPStatus.BAD_REQUEST,
    protocol.BUSY: HTTPStatus.TOO_MANY_REQUESTS,
    protocol.SHUTTING_DOWN: HTTPStatus.SERVICE_UNAVAILABLE,
}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ApiError(Exception):
    def __init__(self, status: HTTPStatus, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def chat_params(body: dict[str, Any], model_path: Path) -> dict[str, Any]:
    """Turn an OpenAI chat request into a daemon ``chat`` request (ApiError if it cannot)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(HTTPStatus.BAD_REQUEST, "'messages' must be a non-empty list")
    system_parts: list[str] = []
    turns: list[dict[str, str]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ApiError(HTTPStatus.BAD_REQUEST, "each message needs a string 'content'")
        role = message.get("role")
        if role in ("system", "developer"):
            system_parts.append(message["content"])
        elif role in ("user", "assistant"):
            turns.append({"role": role, "content": message["content"]})
        else:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"unsupported message role {role!r}")
    if not turns or turns[-1]["role"] != "user":
        raise ApiError(HTTPStatus.BAD_REQUEST, "the last message must be the user's")
    history = turns[:-1]
    if any(m["role"] != ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(history)):
        raise ApiError(HTTPStatus.BAD_REQUEST, "messages must alternate user and assistant")
    params: dict[str, Any] = {
        # Each request is its own session: the daemon finds the shared prefix in its slots.
        "session": uuid.uuid4().hex,
        "message": turns[-1]["content"],
        "history": history,
        "system": "\n\n".join(system_parts) or None,
        "model": str(model_path),
    }
    for key in ("temperature", "top_p", "seed"):
        if body.get(key) is not None:
            params[key] = body[key]
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        params["max_tokens"] = limit
    return params


class ApiServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        paths: Paths,
        settings: Settings,
        model_path: Path,
        model_name: str,
        api_key: str | None,
        announce: Callable[[str], None],
    ) -> None:
        self.paths, self.settings, self.model_path = paths, settings, model_path
        self.model_name, self.api_key, self.announce = model_name, api_key, announce
        self.http_requests: Counter[tuple[str, int]] = Counter()
        self.lock = threading.Lock()
        super().__init__(address, ApiHandler)


class ApiHandler(BaseHTTPRequestHandler):
    server: ApiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # --- plumbing -----------------------------------------------------------------------------

    def _count(self, status: int) -> None:
        with self.server.lock:
            self.server.http_requests[(self.path.split("?")[0], status)] += 1

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self._count(status)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _error(self, error: ApiError) -> None:
        self._json(error.status, {"error": {"message": error.message, "type": error.kind,
                                            "code": int(error.status)}})  # fmt: skip

    def _authorized(self) -> bool:
        key = self.server.api_key
        if key is None:
            return True
        offered = self.headers.get("Authorization", "")
        return hmac.compare_digest(offered.encode(), f"Bearer {key}".encode())

    def _route(self, method: str) -> None:
        try:
            if not self._authorized():
                raise ApiError(HTTPStatus.UNAUTHORIZED, "missing or wrong API key",
                               "authentication_error")  # fmt: skip
            handler = {
                ("GET", "/health"): self._health,
                ("GET", "/metrics"): self._metrics,
                ("GET", "/v1/models"): self._models,
                ("POST", "/v1/chat/completions"): self._chat,
            }.get((method, self.path.split("?")[0]))
            if handler is None:
                raise ApiError(HTTPStatus.NOT_FOUND, f"no route {method} {self.path}")
            handler()
        except ApiError as error:
            self._error(error)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the HTTP client went away; the daemon request was cancelled with it

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    # --- routes -------------------------------------------------------------------------------

    def _health(self) -> None:
        try:
            state = daemon_status(self.server.paths).get("state")
        except Phi4Error:
            state = "stopped"
        status = HTTPStatus.OK if state == "ready" else HTTPStatus.SERVICE_UNAVAILABLE
        self._json(status, {"status": "ok" if state == "ready" else state})

    def _models(self) -> None:
        created = int(self.server.model_path.stat().st_mtime)
        self._json(HTTPStatus.OK, {"object": "list", "data": [
            {"id": self.server.model_name, "object": "model", "created": created,
             "owned_by": "phi4"}]})  # fmt: skip

    def _metrics(self) -> None:
        try:
            status = daemon_status(self.server.paths)
        except Phi4Error:
            status = {}
        metrics = status.get("metrics") or {}
        lines = [
            "# HELP phi4_up Whether the daemon answers (1) or not (0).",
            "# TYPE phi4_up gauge",
            f"phi4_up {1 if status else 0}",
            "# HELP phi4_requests_total Requests the daemon finished.",
            "# TYPE phi4_requests_total counter",
            f"phi4_requests_total {metrics.get('requests', 0)}",
            "# HELP phi4_queue_depth Requests waiting for a slot.",
            "# TYPE phi4_queue_depth gauge",
            f"phi4_queue_depth {status.get('queued', 0)}",
            "# HELP phi4_requests_active Requests being answered.",
            "# TYPE phi4_requests_active gauge",
            f"phi4_requests_active {status.get('requests_active', 0)}",
            "# HELP phi4_tokens_total Tokens by kind: prompt, cached (of the prompt), completion.",
            "# TYPE phi4_tokens_total counter",
            *(f'phi4_tokens_total{{kind="{kind}"}} {metrics.get(f"{kind}_tokens", 0)}'
              for kind in ("prompt", "cached", "completion")),
            "# HELP phi4_request_duration_seconds Time from a request's start to its end.",
            "# TYPE phi4_request_duration_seconds histogram",
        ]  # fmt: skip
        for bound, count in (metrics.get("latency_buckets") or {}).items():
            lines.append(f'phi4_request_duration_seconds_bucket{{le="{bound}"}} {count}')
        lines += [
            f'phi4_request_duration_seconds_bucket{{le="+Inf"}} {metrics.get("requests", 0)}',
            f"phi4_request_duration_seconds_sum {metrics.get('latency_sum_s', 0.0)}",
            f"phi4_request_duration_seconds_count {metrics.get('requests', 0)}",
            "# HELP phi4_errors_total Requests that ended in an error, by code.",
            "# TYPE phi4_errors_total counter",
            *(f'phi4_errors_total{{code="{code}"}} {count}'
              for code, count in (metrics.get("errors") or {}).items()),
            "# HELP phi4_http_requests_total HTTP requests served, by path and status.",
            "# TYPE phi4_http_requests_total counter",
        ]  # fmt: skip
        with self.server.lock:
            for (path, code), count in sorted(self.server.http_requests.items()):
                lines.append(f'phi4_http_requests_total{{path="{path}",status="{code}"}} {count}')
        body = ("\n".join(lines) + "\n").encode()
        self._send(HTTPStatus.OK, body, "text/plain; version=0.0.4; charset=utf-8")

    def _read_body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "request body too large")
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError as exc:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"malformed JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        return body

    def _chat(self) -> None:
        body = self._read_body()
        params = chat_params(body, self.server.model_path)
        stream = bool(body.get("stream"))
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        server = self.server
        try:
            connection = connect_checked(server.paths, server.settings, server.model_path,
                                         server.announce)  # fmt: skip
        except DaemonUnavailableError as exc:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "server_error") from None
        with connection:
            events = connection.request("chat", params)
            if stream:
                self._stream(events, completion_id, created)
            else:
                self._complete(events, completion_id, created)

    def _chunk(self, completion_id: str, created: int, delta: dict[str, Any],
               finish: str | None = None) -> bytes:  # fmt: skip
        chunk = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                 "model": self.server.model_name,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def _stream(self, events: Any, completion_id: str, created: int) -> None:
        started = False
        stats: dict[str, Any] = {}
        for event in events:
            kind = event.get("event")
            if kind == "error" and not started:
                raise _api_error(event)
            if not started:
                self._count(HTTPStatus.OK)
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                self.wfile.write(self._chunk(completion_id, created,
                                             {"role": "assistant", "content": ""}))  # fmt: skip
                started = True
            if kind == "token":
                self.wfile.write(self._chunk(completion_id, created, {"content": event["text"]}))
            elif kind == "reasoning":
                self.wfile.write(self._chunk(completion_id, created,
                                             {"reasoning_content": event["text"]}))  # fmt: skip
            elif kind == "stats":
                stats = event
            elif kind in protocol.TERMINAL_EVENTS:
                finish = _finish_reason(stats)
                self.wfile.write(self._chunk(completion_id, created, {}, finish))
                self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    def _complete(self, events: Any, completion_id: str, created: int) -> None:
        answer, reasoning = "", ""
        stats: dict[str, Any] = {}
        for event in events:
            kind = event.get("event")
            if kind == "token":
                answer += event["text"]
            elif kind == "reasoning":
                reasoning += event["text"]
            elif kind == "retract":
                reasoning, answer = reasoning + answer, ""
            elif kind == "stats":
                stats = event
            elif kind == "error":
                raise _api_error(event)
        message: dict[str, Any] = {"role": "assistant", "content": answer}
        if reasoning:
            message["reasoning_content"] = reasoning
        prompt, completion = stats.get("prompt_tokens", 0), stats.get("completion_tokens", 0)
        self._json(HTTPStatus.OK, {
            "id": completion_id, "object": "chat.completion", "created": created,
            "model": self.server.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(stats)}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": stats.get("cached_tokens", 0)}},
        })  # fmt: skip


def _finish_reason(stats: dict[str, Any]) -> str:
    return "length" if stats.get("finish_reason") in ("length", "context") else "stop"


def _api_error(event: dict[str, Any]) -> ApiError:
    code = str(event.get("code"))
    status = _HTTP_STATUS_FOR.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, str(event.get("message")), kind)


def serve(
    paths: Paths,
    settings: Settings,
    model_path: Path,
    model_name: str,
    address: str,
    api_key: str | None,
    announce: Callable[[str], None],
) -> None:
    """Serve until interrupted. Raise UsageError for a bad address or a public bind without key."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port_text.isdigit():
        raise UsageError(f"bad address {address!r}: use HOST:PORT, e.g. 127.0.0.1:8080")
    if not is_loopback(host) and not api_key:
        raise UsageError(f"binding {host} (not loopback) needs --api-key")
    connect_checked(paths, settings, model_path, announce).close()  # start the daemon now
    server_class: Any = ApiServer
    if ":" in host:

        class ApiServer6(ApiServer):
            address_family = socket.AF_INET6

        server_class = ApiServer6
    try:
        httpd = server_class((host, int(port_text)), paths, settings, model_path, model_name,
                             api_key, announce)  # fmt: skip
    except OSError as exc:
        raise UsageError(f"cannot listen on {address}: {exc.strerror}") from None
    bound_host, bound_port = httpd.server_address[:2]
    announce(f"serving the OpenAI API on http://{bound_host}:{bound_port}/v1 (Ctrl-C stops)")
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
