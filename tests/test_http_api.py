"""`phi4 serve --http`: the OpenAI-compatible API, driven by the official `openai` client."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import PHI4, run_phi4


def start_server(
    model: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [PHI4, "serve", "--http", "127.0.0.1:0", "-m", str(model), *extra],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
        if found:
            return proc, found.group(1)
    raise AssertionError("the server did not start")


@pytest.fixture
def server(tiny_model: Path) -> Iterator[str]:
    proc, url = start_server(tiny_model)
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_chat_completions_streaming_and_not_agree(server: str):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 12*13?"}]  # fmt: skip
    whole = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                           max_tokens=12)  # fmt: skip
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    streamed = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                              max_tokens=12, stream=True)  # fmt: skip
    chunks = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(chunks) == text
    follow_up = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=4,
        messages=[*messages, {"role": "assistant", "content": text},
                  {"role": "user", "content": "And twice that?"}],
    )  # fmt: skip
    assert follow_up.usage is not None
    assert follow_up.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]


def test_models_health_and_metrics(server: str, tiny_model: Path):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == [tiny_model.stem]
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=2)  # fmt: skip
    status, body = get(f"{server}/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    status, text = get(f"{server}/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["phi4_requests"].samples[0].value >= 1
    assert families["phi4_request_duration_seconds"].type == "histogram"
    kinds = {s.labels["kind"] for s in families["phi4_tokens"].samples}
    assert kinds == {"prompt", "cached", "completion"}
    assert run_phi4("stop").returncode == 0
    status, body = get(f"{server}/health")
    assert status == 503 and json.loads(body)["status"] == "stopped"


def test_bad_requests_get_openai_style_errors(server: str):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="last message must be the user"):
        client.chat.completions.create(model="tiny", messages=[{"role": "assistant",
                                                               "content": "hi"}])  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny", prompt="hi")


def test_api_key_is_required_when_set_and_for_public_binds(tiny_model: Path):
    refused = run_phi4("serve", "--http", "0.0.0.0:0", "-m", str(tiny_model))
    assert refused.returncode == 2 and "needs --api-key" in refused.stderr
    proc, url = start_server(tiny_model, "--api-key", "s3cret")
    try:
        assert get(f"{url}/v1/models")[0] == 401
        status, _ = get(f"{url}/v1/models", {"Authorization": "Bearer s3cret"})
        assert status == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)


def _stream_then(server: str, action: Any) -> tuple[str, Exception | None]:
    """Stream a long answer; once it has begun, run ``action``; return (text, error raised)."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    streamed = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count."}], temperature=0,
        max_tokens=3000, stream=True,
    )  # fmt: skip
    text = ""
    try:
        for number, chunk in enumerate(streamed):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                assert chunk.choices[0].finish_reason is None, "it must not end as a success"
            if number == 5:
                action()
    except openai.APIError as error:
        return text, error
    return text, None


def test_a_daemon_that_dies_mid_stream_is_an_error_event_not_a_traceback(tiny_model: Path):
    # Before: a traceback in the server, and the SSE stream cut with no end.
    proc, url = start_server(tiny_model)
    try:
        pid = json.loads(run_phi4("status", "--json").stdout)["pid"]
        text, error = _stream_then(url, lambda: os.kill(pid, signal.SIGKILL))
        assert text, "the answer had begun"
        assert isinstance(error, openai.APIError)
        assert "the daemon went away mid-answer" in str(error)
        # The server lives on, and starts a fresh daemon for the next request.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        again = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert again.choices[0].message.content is not None
    finally:
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=20)
    assert "Traceback" not in err, err


def test_phi4_stop_mid_stream_is_reported_as_an_error(server: str):
    # Before: `phi4 stop` reached the HTTP client as finish_reason "stop" and [DONE].
    text, error = _stream_then(server, lambda: run_phi4("stop"))
    assert text
    assert isinstance(error, openai.APIError)
    assert "shutting down" in str(error)


def test_a_stuck_client_does_not_hold_up_others(server: str):
    body = json.dumps({"model": "tiny", "stream": True, "max_tokens": 3000, "temperature": 0,
                       "messages": [{"role": "user", "content": "Count."}]}).encode()  # fmt: skip
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as stuck:
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
        assert stuck.recv(64).startswith(b"HTTP/1.1 200")  # streaming, and never read again
        client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0,
                               timeout=60)  # fmt: skip
        for _ in range(3):
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert reply.choices[0].finish_reason == "length"


def _raw(url: str, data: bytes, wait: float = 10) -> bytes:
    """Send raw bytes; return the response: its headers and, by Content-Length, its body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(wait)
        sock.sendall(data)
        received = b""
        with contextlib.suppress(TimeoutError):
            while chunk := sock.recv(4096):
                received += chunk
                head, found, body = received.partition(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: (\d+)", head)
                if found and length and len(body) >= int(length.group(1)):
                    break
        return received


BODY = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'


def test_malformed_http_requests_get_an_answer_and_the_server_goes_on(tiny_model: Path):
    # Before (http.server): a malformed Content-Length, a short body, a chunked body or invalid
    # UTF-8 got no reply, hung a handler or desynchronised the connection.
    proc, url = start_server(tiny_model, env={"PHI4_HTTP_HEADER_TIMEOUT": "2",
                                              "PHI4_HTTP_BODY_TIMEOUT": "2"})  # fmt: skip
    try:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        assert _raw(url, head + b"Content-Length: abc\r\n\r\n" + BODY).startswith(b"HTTP/1.1 400")
        short = _raw(url, head + b"Content-Length: 500\r\n\r\n" + BODY)
        assert short.startswith(b"HTTP/1.1 408") and b"did not arrive within 2 s" in short
        chunked = _raw(url, head + b"Transfer-Encoding: chunked\r\n\r\n"
                       + f"{len(BODY):x}\r\n".encode() + BODY + b"\r\n0\r\n\r\n")  # fmt: skip
        assert chunked.startswith(b"HTTP/1.1 200") and b'"chat.completion"' in chunked
        bad = b'{"messages":[{"role":"user","content":"\xff\xfe"}]}'
        answer = _raw(url, head + f"Content-Length: {len(bad)}\r\n\r\n".encode() + bad)
        assert answer.startswith(b"HTTP/1.1 400") and b"not UTF-8" in answer
        # Slowloris: headers that never end are cut off, not waited for.
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as slow:
            slow.settimeout(10)
            slow.sendall(head)
            assert slow.recv(100) == b"", "the server hung up on the unfinished request"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content is not None
    finally:
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=20)
    assert "Traceback" not in err, err
