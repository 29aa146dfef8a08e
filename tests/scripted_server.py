"""A scripted OpenAI-compatible server: streams chat completions the way llama-server and vLLM do
(thinking in ``reasoning_content`` or ``reasoning``, or inline), and misbehaves on request —
malformed chunks, in-stream errors, stalls, dropped connections, endless or trickling bodies,
refusals with Retry-After, a socket that never accepts — so `--backend` can be tested against
every failure without a real model. It records each request body it receives."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# A script turns the request body into the raw text to send, piece by piece, each written and
# flushed as it comes (usually a complete SSE "data:" line; bytes are written as they are), or a
# Step that does something other than write; a Head first answers with another status than a
# 200 stream. It may be a bounded generator, for bodies too long to build.
Script = Callable[[dict[str, Any]], Iterable["str | bytes | Step | Head"]]


@dataclass
class Step:
    sleep: float = 0.0
    drop: bool = False  # close the connection here, mid-stream


@dataclass
class Head:
    """The status line and headers to answer with; the script's pieces after it are the body.
    With ``raw``, no status line or headers are sent: the pieces are the whole response."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    raw: bool = False


def data(payload: Any) -> str:
    return "data: " + (payload if isinstance(payload, str) else json.dumps(payload)) + "\n\n"


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
    return data(
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            **extra,
        }
    )


def usage(prompt: int, completion: int, reasoning: int | None = None) -> str:
    details = {"reasoning_tokens": reasoning} if reasoning is not None else None
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if details:
        body["completion_tokens_details"] = details
    return data({"id": "c1", "object": "chat.completion.chunk", "choices": [], "usage": body})


def separated(
    field_name: str, thinking: list[str], answer: list[str], with_usage: bool = True
) -> list[str | Step]:
    """llama-server (reasoning_content) or vLLM/Ollama (reasoning): thinking in its own field."""
    lines: list[str | Step] = [chunk({"role": "assistant", "content": ""})]
    lines += [chunk({field_name: piece}) for piece in thinking]
    lines += [chunk({"content": piece}) for piece in answer]
    lines.append(chunk({}, "stop"))
    if with_usage:
        lines.append(usage(20, len(thinking) + len(answer), len(thinking)))
    lines.append(data("[DONE]"))
    return lines


@dataclass
class ScriptedServer:
    script: Script
    bodies: list[dict[str, Any]] = field(default_factory=list)
    status: int = 200
    url: str = ""
    metrics: Callable[[], str] | None = None  # the /metrics page, made at each GET
    models: list[str] | None = None  # the ids /v1/models lists (no such page without)


@contextmanager
def scripted_server(
    script: Script,
    status: int = 200,
    metrics: Callable[[], str] | None = None,
    models: list[str] | None = None,
) -> Iterator[ScriptedServer]:
    state = ScriptedServer(script, status=status, metrics=metrics, models=models)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            page = state.metrics() if state.metrics and self.path == "/metrics" else None
            if state.models is not None and self.path == "/v1/models":
                page = json.dumps(
                    {
                        "object": "list",
                        "data": [
                            {"id": name, "object": "model", "owned_by": "test"}
                            for name in state.models
                        ],
                    }
                )
            payload = (page or "not here").encode()
            self.send_response(200 if page is not None else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.bodies.append(body)
            if state.status != 200:
                payload = json.dumps(
                    {"error": {"message": "scripted refusal", "code": state.status}}
                ).encode()
                self.send_response(state.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            pieces = iter(state.script(body))
            first = next(pieces, None)
            head = first if isinstance(first, Head) else Head(200)
            self.close_connection = True
            if not head.raw:
                self.send_response(head.status)
                headers = {"Content-Type": "text/event-stream", **head.headers}
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Connection", "close")
                self.end_headers()
            if first is not None and not isinstance(first, Head):
                pieces = itertools.chain([first], pieces)
            for line in pieces:
                if isinstance(line, Head):
                    continue
                if isinstance(line, Step):
                    if line.sleep:
                        time.sleep(line.sleep)
                    if line.drop:
                        return
                    continue
                try:
                    self.wfile.write(line if isinstance(line, bytes) else line.encode())
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def never_accepting(backlog_full: bool) -> Iterator[str]:
    """The URL of a socket that listens and never accepts. With ``backlog_full`` its queue is
    filled first, so a new connection is never even taken (as from a server too loaded to keep
    up, or an address that drops packets); without, the kernel takes the connection and the
    request, and nothing ever answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers: list[socket.socket] = []
    try:
        while backlog_full:  # until a connection is not taken: then the queue is full
            filler = socket.socket()
            fillers.append(filler)
            filler.settimeout(0.5)
            try:
                filler.connect(listener.getsockname())
            except TimeoutError:
                break
            assert len(fillers) < 16, "the kernel keeps taking connections"
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
