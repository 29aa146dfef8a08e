"""`phi4 serve --http`: the OpenAI-compatible API, driven by the official `openai` client."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
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
    address = "127.0.0.1:0"
    if extra and extra[0].startswith("--http="):
        address, extra = extra[0].removeprefix("--http="), extra[1:]
    proc = subprocess.Popen(
        [PHI4, "serve", "--http", address, "-m", str(model), *extra],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"(http://(?:127\.0\.0\.1|\[::1\]):\d+)/v1", line)
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


@contextlib.contextmanager
def serving_apart(model: Path) -> Iterator[str]:
    """`phi4 serve` on ``model`` with a PHI4_HOME of its own (short: a socket's path is in it),
    for a module's fixture (each test's own PHI4_HOME would start a daemon per test); whatever
    it started is stopped and its home removed after."""
    from tests.conftest import _stop_processes_in

    home = Path(tempfile.mkdtemp(prefix="p4-", dir="/tmp"))
    proc, url = start_server(
        model, env={"PHI4_HOME": str(home), "PHI4_LOOP": "off", "PHI4_THREADS": "1"}
    )
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
        _stop_processes_in(home)
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def serving(model: Path, *extra: str) -> Iterator[str]:
    proc, url = start_server(model, *extra)
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    return fetch(url, headers=headers)


def fetch(
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    method: str | None = None,
) -> tuple[int, str]:
    """(status, body) of one request; headers may override ``Host``."""
    request = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def fetch_headers(url: str, headers: dict[str, str], method: str = "GET") -> tuple[int, Any]:
    request = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers
    except urllib.error.HTTPError as error:
        return error.code, error.headers


def chat_body(**fields: Any) -> bytes:
    return json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    ).encode()


JSON = {"Content-Type": "application/json"}


def refusal(status_body: tuple[int, str]) -> tuple[int, str]:
    """(status, message) of an error answer, which must be one line of OpenAI-shaped JSON."""
    status, body = status_body
    assert "\n" not in body.strip(), body
    error = json.loads(body)["error"]
    return status, error["message"]


@pytest.mark.daemon
def test_chat_completions_streaming_and_not_agree(server: str):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12*13?"},
    ]
    whole = client.chat.completions.create(
        model="tiny-phi3", messages=messages, temperature=0, max_tokens=12
    )
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    streamed = client.chat.completions.create(
        model="tiny-phi3", messages=messages, temperature=0, max_tokens=12, stream=True
    )
    chunks = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(chunks) == text
    follow_up = client.chat.completions.create(
        model="tiny-phi3",
        temperature=0,
        max_tokens=4,
        messages=[
            *messages,
            {"role": "assistant", "content": text},
            {"role": "user", "content": "And twice that?"},
        ],
    )
    assert follow_up.usage is not None
    assert follow_up.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]


@pytest.mark.daemon
def test_models_health_and_metrics(server: str, tiny_model: Path):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == [tiny_model.stem]
    client.chat.completions.create(
        model="tiny-phi3", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
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


@pytest.mark.daemon
def test_bad_requests_get_openai_style_errors(server: str):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="last message must be the user") as bad:
        client.chat.completions.create(
            model="tiny-phi3", messages=[{"role": "assistant", "content": "hi"}]
        )
    assert bad.value.param == "messages"
    with pytest.raises(openai.BadRequestError, match="non-empty list") as bad:
        client.chat.completions.create(model="tiny-phi3", messages=[])
    assert bad.value.param == "messages"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny-phi3", prompt="hi")


@pytest.mark.daemon
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
        model="tiny-phi3",
        messages=[{"role": "user", "content": "Count."}],
        temperature=0,
        max_tokens=3000,
        stream=True,
    )
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


@pytest.mark.daemon
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
            model="tiny-phi3", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert again.choices[0].message.content is not None
    finally:
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=20)
    assert "Traceback" not in err, err


@pytest.mark.daemon
def test_phi4_stop_mid_stream_is_reported_as_an_error(tiny_model: Path):
    # Before: `phi4 stop` reached the HTTP client as finish_reason "stop" and [DONE]. The loop
    # detector is off: the tiny model's greedy "count" repeats itself and was ended after 950
    # tokens, 0.3 s, sometimes before `phi4 stop` had started (a test racing the machine).
    proc, url = start_server(tiny_model, env={"PHI4_LOOP": "off"})
    try:
        text, error = _stream_then(url, lambda: run_phi4("stop"))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
    assert text
    assert isinstance(error, openai.APIError)
    assert "shutting down" in str(error)


@pytest.mark.daemon
def test_a_stuck_client_does_not_hold_up_others(server: str):
    body = json.dumps(
        {
            "model": "tiny-phi3",
            "stream": True,
            "max_tokens": 3000,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Count."}],
        }
    ).encode()
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as stuck:
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert stuck.recv(64).startswith(b"HTTP/1.1 200")  # streaming, and never read again
        client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)
        for _ in range(3):
            reply = client.chat.completions.create(
                model="tiny-phi3", messages=[{"role": "user", "content": "hi"}], max_tokens=4
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


BODY = b'{"model":"tiny-phi3","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'


@pytest.mark.daemon
def test_malformed_http_requests_get_an_answer_and_the_server_goes_on(tiny_model: Path):
    # Before (http.server): a malformed Content-Length, a short body, a chunked body or invalid
    # UTF-8 got no reply, hung a handler or desynchronised the connection.
    proc, url = start_server(
        tiny_model, env={"PHI4_HTTP_HEADER_TIMEOUT": "2", "PHI4_HTTP_BODY_TIMEOUT": "2"}
    )
    try:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
        )
        assert _raw(url, head + b"Content-Length: abc\r\n\r\n" + BODY).startswith(b"HTTP/1.1 400")
        short = _raw(url, head + b"Content-Length: 500\r\n\r\n" + BODY)
        assert short.startswith(b"HTTP/1.1 408") and b"did not arrive within 2 s" in short
        chunked = _raw(
            url,
            head
            + b"Transfer-Encoding: chunked\r\n\r\n"
            + f"{len(BODY):x}\r\n".encode()
            + BODY
            + b"\r\n0\r\n\r\n",
        )
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
            model="tiny-phi3", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content is not None
    finally:
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=20)
    assert "Traceback" not in err, err


# --- Who may use the server: Host, Origin, content type, other users ---------------------------


@pytest.mark.daemon
def test_a_foreign_host_is_refused_so_dns_rebinding_fails(tiny_model: Path):
    # Before: `Host: evil.example` got 200, so a page at evil.example resolving to 127.0.0.1
    # could read answers (DNS rebinding).
    with serving(tiny_model, "--allow-host", "my-box.lan") as url:
        port = url.rsplit(":", 1)[1]
        for host in (
            "evil.example",
            f"evil.example:{port}",
            "127.0.0.1.evil.example",
            "127.0.0.2",
            "[::1]",
            f"localhost.evil:{port}",
        ):
            status, message = refusal(fetch(f"{url}/v1/models", headers={"Host": host}))
            assert status == 403, host
            assert "is not this server" in message and "--allow-host" in message
        for host in (f"127.0.0.1:{port}", "localhost", f"LocalHost.:{port}", "my-box.lan:9000"):
            assert fetch(f"{url}/v1/models", headers={"Host": host})[0] == 200, host
        # Unknown paths and methods are refused the same way, and answer JSON otherwise.
        assert fetch(f"{url}/nope", headers={"Host": "evil.example"})[0] == 403
        assert refusal(fetch(f"{url}/nope"))[0] == 404
        post = fetch(f"{url}/v1/chat/completions", chat_body(), JSON | {"Host": "evil.example"})
        assert post[0] == 403


@pytest.mark.daemon
def test_an_ipv6_loopback_server_checks_bracketed_hosts(tiny_model: Path):
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with serving(tiny_model, "--http=[::1]:0") as url:
        port = url.rsplit(":", 1)[1]
        assert url.startswith("http://[::1]:")
        for host in (f"[::1]:{port}", "[::1]", "[0:0:0:0:0:0:0:1]", "localhost"):
            assert fetch(f"{url}/v1/models", headers={"Host": host})[0] == 200, host
        for host in ("127.0.0.1", "[::2]", "[::1", "evil.example"):
            assert fetch(f"{url}/v1/models", headers={"Host": host})[0] == 403, host
        # The uid check finds the peer in /proc/net/tcp6.
        status, body = fetch(f"{url}/v1/chat/completions", chat_body(), JSON)
        assert status == 200, body


@pytest.mark.daemon
def test_cross_site_requests_and_simple_content_types_are_refused(server: str):
    # Before: a cross-site `Content-Type: text/plain` POST from a web page ran a completion.
    url = f"{server}/v1/chat/completions"
    body = chat_body()
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"):
        status, message = refusal(
            fetch(url, body, {"Content-Type": kind, "Origin": "https://evil.example"})
        )
        assert status == 403 and "cross-origin" in message and "--allow-origin" in message
        status, message = refusal(fetch(url, body, {"Content-Type": kind}))
        assert status == 415 and "application/json" in message, kind
    assert (
        refusal(fetch(url, body, {"Content-Type": "application/json; charset=latin-1"}))[0] == 415
    )
    for origin in ("null", "http://localhost:1", "http://127.0.0.1.evil.example"):
        assert fetch(url, body, JSON | {"Origin": origin})[0] == 403, origin
    # A preflight from a foreign origin is refused, and nothing is CORS-enabled by default.
    status, headers = fetch_headers(
        url, {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}, "OPTIONS"
    )
    assert status == 403 and "access-control-allow-origin" not in headers
    status, headers = fetch_headers(f"{server}/v1/models", {})
    assert status == 200 and "access-control-allow-origin" not in headers
    # JSON with a charset parameter, and a same-origin request, are fine.
    own = server.removeprefix("http://")
    status, text = fetch(
        url, body, {"Content-Type": "Application/JSON; charset=UTF-8", "Origin": f"http://{own}"}
    )
    assert status == 200, text


@pytest.mark.daemon
def test_an_allowed_origin_gets_cors(tiny_model: Path):
    with serving(tiny_model, "--allow-origin", "http://localhost:3000") as url:
        origin = {"Origin": "http://localhost:3000"}
        status, headers = fetch_headers(
            f"{url}/v1/chat/completions",
            origin
            | {
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type",
            },
            "OPTIONS",
        )
        assert status == 204
        assert headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in headers["access-control-allow-methods"]
        status, headers = fetch_headers(f"{url}/v1/models", origin)
        assert status == 200
        assert headers["access-control-allow-origin"] == "http://localhost:3000"
        assert fetch(f"{url}/v1/models", headers={"Origin": "http://localhost:3001"})[0] == 403
    refused = run_phi4("serve", "--http", "127.0.0.1:0", "--allow-origin", "localhost:3000")
    assert refused.returncode == 2 and "bad --allow-origin" in refused.stderr
    refused = run_phi4("serve", "--http", "127.0.0.1:0", "--allow-host", "a b")
    assert refused.returncode == 2 and "bad --allow-host" in refused.stderr


def _as_nobody(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *command],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _curl(url: str, *extra: str) -> list[str]:
    return ["curl", "-s", "-w", "\n%{http_code}", *extra, url]


needs_second_user = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("curl"),
    reason="acting as user nobody needs root, setpriv and curl",
)


@needs_second_user
@pytest.mark.daemon
def test_without_a_key_another_local_user_is_refused(tiny_model: Path):
    # Before: user nobody got 200 from the owner's keyless server on loopback.
    with serving(tiny_model) as url:
        post = ["-H", "Content-Type: application/json", "-d", chat_body().decode()]
        for path, extra in (
            ("/v1/chat/completions", post),
            ("/v1/models", []),
            ("/health", []),
            ("/metrics", []),
        ):
            done = _as_nobody(*_curl(f"{url}{path}", *extra))
            body, _, status = done.stdout.rpartition("\n")
            assert status == "403", (path, done.stdout, done.stderr)
            message = json.loads(body)["error"]["message"]
            assert f"only its owner (uid {os.getuid()})" in message and "--api-key" in message
            assert f"uid {pwd.getpwnam('nobody').pw_uid}" in message
        owner = subprocess.run(
            _curl(f"{url}/v1/chat/completions", *post),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert owner.stdout.rpartition("\n")[2] == "200", owner.stdout
        # An IPv6 socket reaching the IPv4 server (::ffff:127.0.0.1) is found in tcp6.
        mapped = url.replace("127.0.0.1", "[::ffff:127.0.0.1]")
        done = _as_nobody(*_curl(f"{mapped}/v1/models", "-g"))
        if "Could not connect" not in done.stderr and done.stdout.strip() != "000":
            assert done.stdout.rpartition("\n")[2] == "403", (done.stdout, done.stderr)
            owner = subprocess.run(
                _curl(f"{mapped}/v1/models", "-g"),
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert owner.stdout.rpartition("\n")[2] == "200", owner.stdout
    # With a key, the key is enough; --any-local-user opens a keyless server to everyone.
    with serving(tiny_model, "--api-key", "s3cret") as url:
        done = _as_nobody(*_curl(f"{url}/v1/models", "-H", "Authorization: Bearer s3cret"))
        assert done.stdout.rpartition("\n")[2] == "200", done.stdout
        done = _as_nobody(*_curl(f"{url}/v1/models"))
        assert done.stdout.rpartition("\n")[2] == "401", done.stdout
    with serving(tiny_model, "--any-local-user") as url:
        done = _as_nobody(*_curl(f"{url}/v1/models"))
        assert done.stdout.rpartition("\n")[2] == "200", done.stdout


def test_the_peer_uid_is_read_from_proc_and_unknown_peers_are_refused():
    from phi4cli.serve.http_access import peer_uid_from_proc

    for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            listener = socket.socket(family)
            listener.bind((address, 0))
        except OSError:
            continue  # no IPv6 here
        with listener:
            listener.listen()
            with socket.create_connection(listener.getsockname()[:2]) as client:
                accepted, peer = listener.accept()
                with accepted:
                    local = accepted.getsockname()[:2]
                    assert peer_uid_from_proc(peer[:2], local) == os.getuid()
                    assert client.getsockname()[:2] == peer[:2]
                    # No such connection: the uid cannot be told.
                    assert peer_uid_from_proc((address, 1), local) is None


def test_a_peer_whose_uid_cannot_be_told_is_refused_fail_closed(tiny_model: Path):
    import anyio
    import httpx2

    from phi4cli.backends.daemon import DaemonBackend
    from phi4cli.core.config import Settings
    from phi4cli.core.paths import get_paths
    from phi4cli.serve.http_access import AccessPolicy
    from phi4cli.serve.http_api import create_app

    settings_ = Settings(model=str(tiny_model))
    backend = DaemonBackend(get_paths(), settings_, tiny_model, lambda _m: None)

    def status_with(uid: int | None) -> tuple[int, str]:
        policy = AccessPolicy.create(["127.0.0.1"], peer_uid=lambda _c, _s: uid)
        app = create_app(backend, settings_, str(tiny_model), "tiny-phi3", 0, None, policy)

        async def ask() -> httpx2.Response:
            transport = httpx2.ASGITransport(app=app)
            async with httpx2.AsyncClient(
                transport=transport, base_url="http://127.0.0.1"
            ) as client:
                return await client.get("/metrics")

        response = anyio.run(ask)
        return response.status_code, response.text

    status, text = status_with(None)
    assert status == 403 and "cannot be told" in text and "--api-key" in text
    assert status_with(os.getuid() + 1)[0] == 403
    assert status_with(os.getuid())[0] == 200
    backend.close()


# --- What a request may hold, and which model answers it ---------------------------------------


@pytest.mark.daemon
def test_lone_surrogates_and_deep_nesting_are_400s_naming_the_field(server: str):
    # Before: "\ud800" in content gave a 500 (UnicodeEncodeError on the way to the daemon).
    url = f"{server}/v1/chat/completions"
    cases = {
        '{"messages":[{"role":"user","content":"\\ud800"}]}': "messages[0].content",
        '{"messages":[{"role":"system","content":"ok"},{"role":"user","content":"a\\udfff"}]}': "messages[1].content",  # noqa: E501
        '{"model":"\\ud800","messages":[{"role":"user","content":"hi"}]}': "model",
        '{"stop":["x","\\udc00"],"messages":[{"role":"user","content":"hi"}]}': "stop[1]",
        '{"messages":[{"role":"us\\ud800er","content":"hi"}]}': "messages[0].role",
    }
    for raw, field in cases.items():
        status, message = refusal(fetch(url, raw.encode(), JSON))
        assert status == 400 and message.startswith(f"{field} holds a lone surrogate"), raw
    deep = b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, message = refusal(fetch(url, deep, JSON))
    assert status == 400 and "nested too deeply" in message
    # Before: Python's int() limit (4,300 digits) raised a bare ValueError: a 500, text/plain.
    huge = b'{"seed":' + b"1" * 5000 + b',"messages":[{"role":"user","content":"hi"}]}'
    status, message = refusal(fetch(url, huge, JSON))
    assert status == 400 and "malformed JSON" in message and "digits" in message
    status, text = fetch(url, chat_body(), JSON)  # and the server goes on
    assert status == 200, text


@pytest.mark.daemon
def test_a_request_for_another_model_is_a_404_naming_the_served_one(server: str):
    # Before: a request for phi4-mini-reasoning was answered by whatever model was loaded.
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model="phi4-mini-reasoning", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'phi4-mini-reasoning' is not served here" in error["message"]
    assert "'tiny-phi3'" in error["message"]
    for name in ("tiny-phi3", "TINY-PHI3", "tiny-phi3.gguf", "default"):
        reply = client.chat.completions.create(
            model=name, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.model == "tiny-phi3"
    status, text = fetch(f"{server}/v1/chat/completions", chat_body(), JSON)  # no model given
    assert status == 200, text
    status, message = refusal(fetch(f"{server}/v1/chat/completions", chat_body(model=3), JSON))
    assert status == 400 and "'model' must be a string" in message


# Run as user nobody: hold COUNT connections to HOST:PORT open for SECONDS, each having sent the
# first line of a request and nothing more (a slow client), opening a new one for each the
# server closes; print how many were opened.
_SLOW_CLIENTS = r"""
import socket, sys, time
host, port, count, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
held, opened, end = [], 0, time.monotonic() + seconds
while time.monotonic() < end:
    while len(held) < count:
        s = socket.create_connection((host, port))
        s.setblocking(False)
        try:
            s.send(b"GET /health HTTP/1.1\r\n")
        except OSError:
            pass
        held.append(s)
        opened += 1
    alive = []
    for s in held:
        try:
            if s.recv(1) == b"":
                s.close()
                continue
        except BlockingIOError:
            pass
        except OSError:
            s.close()
            continue
        alive.append(s)
    held = alive
    time.sleep(0.05)
print(opened)
"""


@needs_second_user
@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", [None, "s3cret"])
@pytest.mark.daemon
def test_another_users_slow_connections_do_not_starve_the_owner(tiny_model: Path, key: str | None):
    # Before: 600 slow connections from uid nobody left the owner's /health 503, 8 of 8 tries.
    extra = ("--api-key", key) if key else ()
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    with serving(tiny_model, *extra) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        command = [
            "setpriv",
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            _SLOW_CLIENTS,
            host,
            port,
            "600",
            "25",
        ]
        slow = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(5)  # its connections are open (and refused, and opened again)
            for _ in range(4):
                assert get(f"{url}/health", auth)[0] == 200
                status, body = fetch(
                    f"{url}/v1/chat/completions",
                    chat_body(),
                    {"Content-Type": "application/json", **auth},
                )
                assert status == 200, body
        finally:
            out, err = slow.communicate(timeout=60)
        assert slow.returncode == 0, err
        assert int(out) >= 600, "the slow client did hold its connections open"


def test_each_peer_holds_at_most_its_share_of_connections():
    from phi4cli.serve.http_access import FOREIGN_CONNECTIONS, PEER_CONNECTIONS, PeerGate

    uids = {1111: 1000, 2222: 65534}  # the client port's owner, as /proc would say
    server = ("127.0.0.1", 8080)

    def gate(owner_only: bool) -> PeerGate:
        return PeerGate(owner_only, lambda client, _server: uids.get(client[1]), owner_uid=1000)

    keyless = gate(owner_only=True)
    foreign = [keyless.admit(("127.0.0.1", 2222), server) for _ in range(FOREIGN_CONNECTIONS + 3)]
    assert foreign.count(None) == 3 and keyless.refused == 3
    owner = [keyless.admit(("127.0.0.1", 1111), server) for _ in range(PEER_CONNECTIONS * 2)]
    assert None not in owner, "the owner is bound only by the server's own limit"
    keyless.release(("uid", 65534))
    assert keyless.admit(("127.0.0.1", 2222), server) == ("uid", 65534)
    # With a key (a public bind): each address, and each local uid, up to PEER_CONNECTIONS.
    keyed = gate(owner_only=False)
    remote = [keyed.admit(("203.0.113.9", port), server) for port in range(PEER_CONNECTIONS + 2)]
    assert remote.count(None) == 2
    assert keyed.admit(("203.0.113.10", 1), server) == ("address", "203.0.113.10")
    local = [keyed.admit(("127.0.0.1", 2222), server) for _ in range(PEER_CONNECTIONS + 1)]
    assert local.count(None) == 1


def test_a_port_in_use_is_one_line_that_says_how_to_choose_another(tmp_path: Path):
    from phi4cli.core.config import Settings
    from phi4cli.core.errors import UsageError
    from phi4cli.serve import http_api

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(UsageError) as refused:  # (before any daemon is asked for)
            http_api.serve(
                None,
                Settings(),
                tmp_path / "m.gguf",
                "m",
                address,
                None,  # type: ignore[arg-type]
                print,
            )
    assert str(refused.value) == (
        f"cannot listen on {address}: Address already in use (another server listens there: "
        "give another port, --http HOST:PORT)"
    )


@pytest.mark.daemon
def test_a_prompt_too_long_is_a_400_streamed_or_not_and_a_stream_still_streams(server: str):
    # Before: streamed, the daemon's refusal at admission came after the 200 and the role
    # chunk, as an error event (openai raised a bare APIError); not streamed it was a 400.
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    huge = [{"role": "user", "content": "word " * 40_000}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="shorten them") as refused:
            answer = client.chat.completions.create(model="tiny-phi3", messages=huge, stream=stream)
            if stream:
                list(answer)  # type: ignore[arg-type]
        assert refused.value.param == "messages"  # (the field at fault, as for other 400s)
    # Too long with the tokens asked for: the field is max_tokens, named as the API names it.
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny-phi3", max_tokens=1_000_000, messages=[{"role": "user", "content": "hi"}]
        )
    assert refused.value.param == "max_tokens"
    assert "of max_tokens" in refused.value.message and "--max-tokens" not in refused.value.message
    chunks = list(
        client.chat.completions.create(
            model="tiny-phi3",
            messages=[{"role": "user", "content": "Count."}],
            max_tokens=5,
            temperature=0,
            stream=True,
            n=2,
        )
    )
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    ended = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert ended == ["length", "length"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip(), "the answers came through the reads the stream took over"


@pytest.mark.daemon
def test_a_model_is_retrieved_by_any_name_it_answers_to_and_counted_once(server: str):
    # Before: GET /v1/models/{id} was a 404, so openai's client.models.retrieve failed.
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    listed = client.models.list().data[0]
    for name in (listed.id, "default", "tiny-phi3.gguf"):
        assert client.models.retrieve(name).id == listed.id
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        client.models.retrieve("another-model")
    for number in range(3):
        with contextlib.suppress(openai.NotFoundError):
            client.models.retrieve(f"made-up-{number}")
    metrics = get(f"{server}/metrics")[1]
    assert "made-up" not in metrics, "a client's words are not a metrics label"
    assert 'path="/v1/models/{id}",status="404"' in metrics


@pytest.mark.daemon
def test_many_choices_do_not_starve_a_client_asking_one(tiny_model: Path):
    # Eight clients stream n=16 at once (128 daemon requests, one connection each) and a ninth
    # asks one question: the burst of connections is taken (no 503 naming the socket), what
    # does not fit is a 429 at once with Retry-After, and the ninth is answered next, not
    # after every choice queued before it.
    proc, url = start_server(tiny_model, env={"PHI4_PARALLEL": "2"})
    finished: list[float] = []
    answers: list[tuple[int, str, str | None]] = []
    streaming = threading.Event()

    def flood() -> None:
        asked = {
            "messages": [{"role": "user", "content": "Count."}],
            "n": 16,
            "stream": True,
            "max_tokens": 200,
            "temperature": 1.0,
        }
        body = json.dumps(asked).encode()
        request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers=JSON)
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                streaming.set()
                for line in response:
                    if b'"finish_reason":"' in line.replace(b" ", b""):
                        finished.append(time.monotonic())
                answers.append((response.status, "", None))
        except urllib.error.HTTPError as error:
            answers.append((error.code, error.read().decode(), error.headers.get("Retry-After")))

    try:
        threads = [threading.Thread(target=flood) for _ in range(8)]
        for thread in threads:
            thread.start()
        assert streaming.wait(120), answers
        time.sleep(0.5)  # the flood's choices are queued or running
        status, body = fetch(f"{url}/v1/chat/completions", chat_body(max_tokens=4), JSON)
        done_before = len(finished)
        for thread in threads:
            thread.join(300)
        assert status == 200, body
        statuses = sorted(code for code, _, _ in answers)
        assert len(answers) == 8 and set(statuses) <= {200, 429}, answers
        served = statuses.count(200) * 16
        assert served >= 16
        assert done_before < served // 2, (done_before, served)
        for code, text, retry_after in answers:
            if code == 429:
                assert retry_after == "2" and "queue" in json.loads(text)["error"]["message"]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)


def test_a_busy_answer_says_when_to_ask_again_and_a_daemon_error_names_no_path():
    from phi4cli.serve.openai_request import ApiError, without_paths

    assert ApiError(429, "the daemon's queue is full").response().headers["retry-after"] == "2"
    assert ApiError(503, "down", "server_error").response().headers["retry-after"] == "2"
    assert "retry-after" not in ApiError(400, "bad").response().headers
    said = without_paths("cannot connect to /run/user/1000/phi4/daemon.sock: Resource busy")
    assert said == "cannot connect to (a path of the server's): Resource busy"
    assert without_paths("n/a and 3/4 stay") == "n/a and 3/4 stay"
