"""Answer now (issue 49): while the model thinks, the user asks for the answer; the thinking
policy closes the thinking, as a think budget reached does, and the model answers from what it
has — through the daemon (the protocol's ``adjust`` with ``answer_now``) and a remote engine
(hung up and asked again with the thinking closed) alike, marked ``answered_early``."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from phi4cli.backends.outcome import Outcome
from phi4cli.core._settings import Ask
from phi4cli.core.protocol import EventKind, Op, SolveParams, Stats
from phi4cli.text.thinking import Act, ThinkingPolicy
from tests.conftest import run_phi4
from tests.scripted_server import Step, chunk, data, scripted_server
from tests.tinymodel import write_text_script_model

START = "Let me work out what three plus four is. "
LOOPING = "I add the two numbers and check the sum once more before I go on. "
ANSWER = " So $\\boxed{7}$."
HEARD = 30  # thinking pieces seen before the answer is asked for now


# --- the policy ---------------------------------------------------------------------------------


def test_answer_now_closes_the_thinking_once_at_the_next_count():
    policy = ThinkingPolicy(None, 0, "answer")
    assert policy.counted(5, True) is Act.GO_ON
    policy.answer_now()
    assert policy.counted(6, True) is Act.ANSWER
    assert policy.closed(True) is Act.GO_ON
    policy.answer_now()  # asked again: nothing more
    assert policy.counted(7, True) is Act.GO_ON and policy.counted(8, False) is Act.GO_ON
    assert policy.stats()["answered_early"] is True and policy.budget_reached is False


def test_answer_now_once_the_thinking_is_over_changes_nothing():
    policy = ThinkingPolicy(10, 100, "answer")
    assert policy.counted(3, False) is Act.GO_ON  # answering already
    policy.answer_now()
    assert policy.counted(4, False) is Act.GO_ON
    assert policy.stats()["answered_early"] is False


def test_no_wait_once_the_answer_was_asked_for_now():
    # --min-think would turn the model's own end of thinking into "Wait": not once the user
    # asked for the answer, acted on or not.
    policy = ThinkingPolicy(None, 100, "answer")
    assert policy.closing(5) is Act.WAIT
    policy.answer_now()
    assert policy.closing(6) is Act.GO_ON


def test_answer_now_with_no_room_to_close_lets_the_thinking_run():
    policy = ThinkingPolicy(None, 0, "answer")
    policy.answer_now()
    assert policy.counted(6, True) is Act.ANSWER
    assert policy.closed(False) is Act.GO_ON
    assert policy.counted(7, True) is Act.GO_ON  # not asked again at every token
    assert policy.stats()["answered_early"] is False


def test_answer_now_comes_before_a_budget_reached_at_the_same_count():
    policy = ThinkingPolicy(10, 0, "answer")
    policy.answer_now()
    assert policy.counted(10, True) is Act.ANSWER
    policy.closed(True)
    assert (policy.answered_early, policy.budget_reached) == (True, False)
    assert policy.counted(11, True) is Act.GO_ON  # the budget does not close it again


# --- through both engines -------------------------------------------------------------------


@pytest.fixture(scope="module")
def endless_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reasoning model whose thinking never ends (LOOPING again and again, to max_tokens),
    and which answers ANSWER once something closes its thinking for it."""
    folder = tmp_path_factory.mktemp("answer-now")
    return write_text_script_model(
        folder / "endless.gguf", START + LOOPING, ANSWER, loop_from=len(START)
    )


def endless_server(body: dict[str, Any]) -> Iterator[str | Step]:
    """Thinks LOOPING's words again and again, a word every 5 ms, up to max_tokens; asked to go
    on from a closed thinking, answers."""
    last = body["messages"][-1]
    if last["role"] == "assistant" and last["content"].endswith("</think>\n\n"):
        yield chunk({"content": ANSWER})
        yield chunk({}, "stop")
        yield data("[DONE]")
        return
    words = [w + " " for w in LOOPING.split()]
    limit = int(body.get("max_tokens") or 4000)
    for i in range(limit):
        yield chunk({"reasoning_content": words[i % len(words)]})
        yield Step(sleep=0.005)
    yield chunk({}, "length")
    yield data("[DONE]")


def _send(sock: socket.socket, request_id: int, op: str, **params: object) -> None:
    request = {"v": 1, "id": request_id, "op": op, "params": params}
    sock.sendall(json.dumps(request).encode() + b"\n")


@pytest.mark.timeout(300)
@pytest.mark.daemon
def test_the_daemon_closes_the_thinking_when_asked_to_answer_now(
    endless_model: Path, phi4_home: Path
):
    assert run_phi4("daemon", "start", "-m", str(endless_model)).returncode == 0
    solve = {"prompt": "What is 3+4?", "temperature": 0, "max_tokens": 4000, "loop": "off"}
    reasoning: dict[int, str] = {1: "", 3: ""}
    answer: dict[int, str] = {1: "", 3: ""}
    stats: dict[int, dict[str, Any]] = {}
    ends: dict[int, dict[str, Any]] = {}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(120)  # a hang, not a slow machine
        sock.connect(str(phi4_home / "run" / "daemon.sock"))
        reader = sock.makefile("rb")
        _send(sock, 1, "solve", **solve)
        heard = 0
        while 1 not in ends:
            event = json.loads(reader.readline())
            kind, request_id = event["event"], event["id"]
            if kind == "reasoning":
                reasoning[request_id] += event["text"]
                heard += 1
                if heard == HEARD:
                    # Mid-thinking: the answer now; a request that is not there, and nonsense.
                    _send(sock, 2, "adjust", target=1, answer_now=True)
                    _send(sock, 4, "adjust", target=99, answer_now=True)
                    _send(sock, 5, "adjust", target=1, answer_now="yes")
            elif kind == "token":
                answer[request_id] += event["text"]
            elif kind == "stats":
                stats[request_id] = event
            elif kind in ("done", "error"):
                ends[request_id] = event
        # One answering already: the answer now changes nothing.
        _send(sock, 3, "solve", **solve, think_budget=10)
        asked = False
        while not {2, 3, 4, 5, 6} <= ends.keys():
            event = json.loads(reader.readline())
            kind, request_id = event["event"], event["id"]
            if kind == "token" and request_id == 3:
                answer[3] += event["text"]
                if not asked:
                    _send(sock, 6, "adjust", target=3, answer_now=True)
                    asked = True
            elif kind == "stats":
                stats[request_id] = event
            elif kind in ("done", "error"):
                ends[request_id] = event
    assert ends[2]["result"] == {"adjusted": True}
    assert ends[4]["result"] == {"adjusted": False}
    assert (ends[5]["code"], ends[5]["message"]) == (
        "bad_request",
        "'answer_now' must be true or false",
    )
    first = stats[1]
    # Closed where it was asked, not at max_tokens: the model answered from what it had.
    assert first["answered_early"] is True and first["finish_reason"] == "stop", first
    assert HEARD <= first["reasoning_tokens"] < 1000, first
    assert (first["budget_reached"], first["thinking_unfinished"]) == (False, False)
    assert answer[1].strip() == ANSWER.strip(), answer[1]
    assert reasoning[1].startswith(START.strip())
    # The second was closed by its budget before the answer now came.
    assert stats[3]["answered_early"] is False and stats[3]["budget_reached"] is True
    assert answer[3].strip() == ANSWER.strip()


def _solve_and_answer_now(backend: Any, model: str) -> Outcome:
    """One request through ``backend``'s stream; the answer asked for now after HEARD pieces
    of thinking."""
    params = SolveParams("What is 3+4?", Ask(temperature=0.0, max_tokens=4000, loop="off"), model)
    outcome = Outcome(0, params.prompt)
    stream = backend.stream(Op.SOLVE, params)
    heard = 0
    try:
        for event in stream:
            outcome.apply(event)
            if event.kind == EventKind.REASONING:
                heard += 1
                if heard == HEARD:
                    stream.answer_now()
                    stream.answer_now()  # a second press asks nothing more
    finally:
        stream.close()
    return outcome


def _answered_early(outcome: Outcome) -> Stats:
    assert outcome.error is None, outcome.error
    stats = outcome.stats
    assert stats is not None
    assert stats.answered_early and stats.finish_reason == "stop", stats
    assert HEARD <= stats.reasoning_tokens < 1000, stats
    assert not stats.thinking_unfinished and not stats.budget_reached
    assert outcome.answer == "7" and outcome.solution.strip() == ANSWER.strip()
    assert outcome.to_json()["stats"]["answered_early"] is True
    return stats


@pytest.mark.timeout(300)
@pytest.mark.daemon
def test_a_backend_stream_answers_now_through_the_daemon(endless_model: Path):
    from phi4cli.backends.daemon import DaemonBackend
    from phi4cli.core.config import Settings
    from phi4cli.core.paths import get_paths

    assert run_phi4("daemon", "start", "-m", str(endless_model)).returncode == 0
    settings = Settings(model=str(endless_model))
    backend = DaemonBackend(get_paths(), settings, endless_model, lambda _m: None)
    try:
        outcome = _solve_and_answer_now(backend, str(endless_model))
    finally:
        backend.close()
    _answered_early(outcome)


@pytest.mark.timeout(300)
@pytest.mark.daemon
def test_a_backend_stream_answers_now_through_a_remote_engine():
    from phi4cli.backends.remote_backend import RemoteBackend

    with scripted_server(endless_server) as server:
        backend = RemoteBackend(server.url, "m", None, 30.0)
        try:
            outcome = _solve_and_answer_now(backend, "m")
        finally:
            backend.close()
        bodies = server.bodies
    stats = _answered_early(outcome)
    # Hung up mid-thinking, and asked again with the thinking so far closed.
    assert len(bodies) == 2, bodies
    closed = bodies[1]["messages"][-1]
    assert closed["role"] == "assistant" and closed["content"].endswith("</think>\n\n")
    assert bodies[1]["continue_final_message"] is True
    assert stats.reasoning_tokens == outcome.reasoning.count(" ") > 0
