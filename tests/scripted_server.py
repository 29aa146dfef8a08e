"""A scripted OpenAI-compatible server: streams chat completions the way llama-server and vLLM do
(thinking in ``reasoning_content`` or ``reasoning``, or inline), and misbehaves on request —
malformed chunks, in-stream errors, stalls, dropped connections — so `--backend` can be tested
against every failure without a real model. It records each request body it receives."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# A script turns the request body into the raw lines to send (each a complete SSE "data:" line,
# or a Step that does something other than write).
Script = Callable[[dict[str, Any]], list["str | Step"]]


@dataclass
class Step:
    sleep: float = 0.0
    drop: bool = False  # close the connection here, mid-stream


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
    body: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                            "total_tokens": prompt + completion}  # fmt: skip
    if details:
        body["completion_tokens_details"] = details
    return data({"id": "c1", "object": "chat.completion.chunk", "choices": [], "usage": body})


def separated(field_name: str, thinking: list[str], answer: list[str],
              with_usage: bool = True) -> list[str | Step]:  # fmt: skip
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


@contextmanager
def scripted_server(script: Script, status: int = 200) -> Iterator[ScriptedServer]:
    state = ScriptedServer(script, status=status)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.bodies.append(body)
            if state.status != 200:
                payload = json.dumps({"error": {"message": "scripted refusal",
                                                "code": state.status}}).encode()  # fmt: skip
                self.send_response(state.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            for line in state.script(body):
                if isinstance(line, Step):
                    if line.sleep:
                        time.sleep(line.sleep)
                    if line.drop:
                        return
                    continue
                try:
                    self.wfile.write(line.encode())
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
