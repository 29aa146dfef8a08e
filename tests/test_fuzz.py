"""Fuzzing with hypothesis: the daemon's socket protocol and the HTTP API take whatever a client
sends, answer each request exactly once, never with an internal error, and keep serving — text
that is not Unicode (lone surrogates), deep nesting, floods cut off by a hang-up and huge chat
histories included.

One real daemon (the tiny model) serves every example; generation is kept to a few tokens so the
whole campaign fits in CI's budget.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.conftest import exchange, run_phi4

# Each test runs phi4 as a process (the command, its daemon or a server).
pytestmark = pytest.mark.daemon

# Text as a hostile client sends it: lone surrogates among ordinary characters (JSON's "\ud800"
# escapes decode to them, and UTF-8 cannot encode them).
# (st.characters never yields surrogates, so they are made from their code points.)
SURROGATES = st.lists(
    st.integers(0xD800, 0xDFFF).map(chr) | st.characters(), min_size=1, max_size=10
).map("".join)
TEXT = st.text(max_size=30) | SURROGATES
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | TEXT,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=8) | SURROGATES, inner, max_size=3)
    ),
    max_leaves=8,
)
KEYS = st.sampled_from(
    [
        "prompt",
        "message",
        "session",
        "history",
        "system",
        "model",
        "temperature",
        "top_p",
        "seed",
        "max_tokens",
        "think_budget",
        "keep_alive",
        "priority",
        "target",
        "confidence_floor",
        "x",
    ]
)
PARAMS = st.dictionaries(KEYS, JSON_VALUES | st.sampled_from(["2+2?", "s1", 0.5, 3]), max_size=6)
# Every op but "stop", which would end the campaign.
OPS = st.sampled_from(
    ["solve", "chat", "status", "ping", "cancel", "adjust", "load", "nope", 7, None]
)


def _bounded(params: dict[str, Any]) -> dict[str, Any]:
    """Keep generations short and models unchanged, so examples stay fast."""
    params = dict(params)
    if not isinstance(params.get("max_tokens"), int) or not 0 < params["max_tokens"] <= 4:
        params["max_tokens"] = 2
    params.pop("model", None)
    params.pop("keep_alive", None)
    return params


@pytest.fixture(scope="module")
def daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    import os

    home = tmp_path_factory.mktemp("fuzz-home")
    old = os.environ.get("PHI4_HOME")
    os.environ["PHI4_HOME"] = str(home)
    assert run_phi4("daemon", "start", "-m", str(tiny_model), "--n-ctx", "2048").returncode == 0
    try:
        yield home / "run" / "daemon.sock"
    finally:
        run_phi4("stop")
        if old is not None:
            os.environ["PHI4_HOME"] = old


def _exchange(path: Path, lines: list[bytes]) -> list[dict[str, Any]]:
    """Send the lines on one connection; return the terminal events, one per line."""
    return [e for e in exchange(path, lines) if e.get("event") in ("done", "error")]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    st.lists(
        st.tuples(OPS, PARAMS, st.sampled_from(["number", "list", "surrogate"])),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from([1, 2]),
)
def test_the_socket_answers_every_request_once_and_lives(
    daemon: Path, requests: list[tuple[Any, dict[str, Any], str]], version: int
):
    lines = []
    for number, (op, params, id_kind) in enumerate(requests):
        # a list is not a valid id, and one with a lone surrogate is not text
        request_id: Any = {"number": number, "list": [number], "surrogate": f"{number}\udc80"}[
            id_kind
        ]
        message = {"v": version, "id": request_id, "op": op, "params": _bounded(params)}
        lines.append(json.dumps(message).encode() + b"\n")
    terminals = _exchange(daemon, lines)  # exactly one terminal event per request
    for event in terminals:
        assert event.get("code") != "internal", event
        if event["event"] == "error":
            assert event["message"] and isinstance(event["retryable"], bool)
    assert _exchange(daemon, [b'{"v":1,"id":"p","op":"ping"}\n'])[0]["event"] == "done"


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=200))
def test_raw_bytes_never_break_the_daemon(daemon: Path, garbage: bytes):
    assume(garbage.replace(b"\n", b" ").strip())  # a blank line is skipped, by design
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(daemon))
        sock.sendall(garbage.replace(b"\n", b" ") + b"\n")
        answer = json.loads(sock.makefile("rb").readline())
    assert answer["event"] in ("error", "done")
    assert answer.get("code") != "internal", answer


MESSAGES = (
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "assistant", "system", "tool", 3]),
                "content": st.text(max_size=20) | JSON_VALUES,
            }
        ),
        max_size=4,
    )
    | JSON_VALUES
)
BODIES = (
    st.fixed_dictionaries(
        {"messages": MESSAGES},
        optional={
            "model": JSON_VALUES,
            "temperature": JSON_VALUES,
            "top_p": JSON_VALUES,
            "seed": JSON_VALUES,
            "max_tokens": st.integers(-5, 3) | JSON_VALUES,
            "stream": st.booleans(),
        },
    )
    | JSON_VALUES
)


ASCII = st.characters(min_codepoint=0x21, max_codepoint=0x7E)  # what a header line carries
HOSTS = st.sampled_from(
    [
        "127.0.0.1",
        "127.0.0.1:8080",
        "localhost",
        "LOCALHOST.:1",
        "evil.example",
        "127.0.0.1.evil.example",
        "[::1]",
        "[::1",
        "",
        "a:b:c",
        "127.0.0.2",
    ]
) | st.text(ASCII, max_size=12)
ALLOWED_HOSTS = {"127.0.0.1", "127.0.0.1:8080", "localhost", "LOCALHOST.:1"}
ORIGINS = (
    st.none()
    | st.text(ASCII, max_size=12)
    | st.sampled_from(["http://127.0.0.1", "https://evil.example", "null", "http://localhost:3000"])
)
CONTENT_TYPES = st.sampled_from(
    [
        "application/json",
        "application/json; charset=utf-8",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "",
    ]
)
# Text with lone surrogates, which JSON can carry but UTF-8 cannot.
SURROGATE_TEXT = st.text(
    alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF) | st.sampled_from("ab 2+"),
    min_size=1,
    max_size=6,
)
MESSAGES = (
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "assistant", "system", "tool", 3]),
                "content": st.text(max_size=20) | SURROGATE_TEXT | JSON_VALUES,
            }
        ),
        max_size=4,
    )
    | JSON_VALUES
)
BODIES = (
    st.fixed_dictionaries(
        {"messages": MESSAGES},
        optional={
            "model": JSON_VALUES | SURROGATE_TEXT | st.sampled_from(["tiny", "default", "gpt"]),
            "temperature": JSON_VALUES,
            "top_p": JSON_VALUES,
            "seed": JSON_VALUES,
            "max_tokens": st.integers(-5, 3) | JSON_VALUES,
            "stop": st.lists(SURROGATE_TEXT, max_size=2),
            "stream": st.booleans(),
        },
    )
    | JSON_VALUES
)


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(BODIES, HOSTS, ORIGINS, CONTENT_TYPES)
def test_the_http_api_answers_any_body_without_a_500(
    daemon: Path, tiny_model: Path, body: Any, host: str, origin: str | None, content_type: str
):
    import anyio
    import httpx2

    from phi4cli.backends.daemon import DaemonBackend
    from phi4cli.core.config import Settings
    from phi4cli.core.paths import get_paths
    from phi4cli.serve.http_access import AccessPolicy
    from phi4cli.serve.http_api import create_app

    settings_ = Settings(model=str(tiny_model))
    backend = DaemonBackend(get_paths(), settings_, tiny_model, lambda _m: None)
    access = AccessPolicy.create(["127.0.0.1"], peer_uid=lambda _c, _s: os.getuid())
    app = create_app(backend, settings_, str(tiny_model), "tiny", 0, None, access)
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 3)
    elif isinstance(body, dict):
        body["max_tokens"] = 2
    headers = {"Host": host, "Content-Type": content_type}
    if origin is not None:
        headers["Origin"] = origin

    async def post() -> httpx2.Response:
        transport = httpx2.ASGITransport(app=app)  # an exception in the app would raise here
        async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            content = json.dumps(body).encode("utf-8", "surrogatepass")
            return await client.post("/v1/chat/completions", content=content, headers=headers)

    response = anyio.run(post)
    assert response.status_code in (200, 400, 403, 404, 413, 415, 429, 503), response.text
    same_origin = origin == "http://127.0.0.1" and host == "127.0.0.1"
    foreign = host not in ALLOWED_HOSTS or (origin is not None and not same_origin)
    assert (response.status_code == 403) == foreign, (host, origin, response.text)
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["message"] and error["code"] in (response.status_code, "model_not_found")
    if not foreign and not content_type.startswith("application/json"):
        assert response.status_code == 415
    backend.close()


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.integers(1, 20_000), st.sampled_from(["[", '{"k":']), st.sampled_from(["x", "prompt"]))
def test_nesting_is_bounded_before_parsing(daemon: Path, depth: int, opener: str, key: str):
    from phi4cli.core.protocol import MAX_NESTING

    closer = "]" if opener == "[" else "}"
    value = opener * depth + "1" + closer * depth
    params = f'{{"prompt":"2+2?","max_tokens":2,"{key}":{value}}}'
    line = ('{"v":1,"id":"n","op":"solve","params":' + params + "}\n").encode()
    (answer,) = _exchange(daemon, [line])
    assert answer.get("code") != "internal", answer
    if depth + 2 > MAX_NESTING:  # the params object and the request's own count too
        assert answer["code"] == "bad_request" and "nested deeper" in answer["message"]
    assert _exchange(daemon, [b'{"v":1,"id":"p","op":"ping"}\n'])[0]["event"] == "done"


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.integers(1, 300), st.integers(0, 3))
def test_a_flood_then_a_hang_up_leaves_room_for_the_next_client(
    daemon: Path, flood: int, read_first: int
):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(daemon))
        sock.sendall(
            b"".join(
                json.dumps(
                    {
                        "v": 1,
                        "id": n,
                        "op": "solve",
                        "params": {"prompt": f"{n}+1?", "max_tokens": 3},
                    }
                ).encode()
                + b"\n"
                for n in range(flood)
            )
        )
        reader = sock.makefile("rb")
        for _ in range(read_first):  # hang up at once, or after a few events
            reader.readline()
    # Whatever the flood left queued, another client is answered, not refused busy.
    (answer,) = _exchange(
        daemon,
        [
            json.dumps(
                {"v": 1, "id": "next", "op": "solve", "params": {"prompt": "2+2?", "max_tokens": 2}}
            ).encode()
            + b"\n"
        ],
    )
    assert answer["event"] == "done", answer


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.sampled_from([2, 40, 400, 1_998, 2_000, 2_002, 6_000]), st.text(max_size=3))
def test_a_huge_chat_history_is_refused_or_trimmed(daemon: Path, messages: int, content: str):
    from phi4cli.core.protocol import MAX_HISTORY_MESSAGES

    history = [{"role": ("user", "assistant")[n % 2], "content": content} for n in range(messages)]
    line = json.dumps(
        {
            "v": 1,
            "id": "h",
            "op": "chat",
            "params": {"session": "fuzz", "message": "hi", "history": history, "max_tokens": 2},
        }
    ).encode()
    (answer,) = _exchange(daemon, [line + b"\n"])
    if messages > MAX_HISTORY_MESSAGES:
        assert answer["code"] == "bad_request" and "the limit is 2,000" in answer["message"]
    else:
        assert answer["event"] == "done", answer
    assert _exchange(daemon, [b'{"v":1,"id":"p","op":"ping"}\n'])[0]["event"] == "done"
