"""`--samples K` and `eval -k K` through a remote engine ask for the samples of a question in one
request with ``n`` (issue 37): the server decodes them together. An engine that refuses ``n``, or
answers one choice, gets each sample on its own from then on; an early stop hangs the shared
request up. Against scripted servers, and against a real `phi4 serve`."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_phi4
from tests.scripted_server import Head, Step, data, scripted_server
from tests.test_http_api import get, start_server

pytestmark = pytest.mark.daemon


def piece(index: int, delta: dict[str, Any], finish: str | None = None) -> str:
    choice = {"index": index, "delta": delta, "finish_reason": finish}
    return data({"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [choice]})


def choices_answering(answers: list[str]) -> Iterator[str | Step]:
    """One stream of ``len(answers)`` choices, interleaved, each ending in its boxed answer."""
    for index in range(len(answers)):
        yield piece(index, {"role": "assistant", "content": ""})
    for index, answer in enumerate(answers):
        yield piece(index, {"content": f"So it is \\boxed{{{answer}}}."})
    for index in range(len(answers)):
        yield piece(index, {}, "stop")
    yield data("[DONE]")


def takes_n(body: dict[str, Any]) -> Iterator[str | Step]:
    return choices_answering(["4"] * int(body.get("n", 1)))


def test_samples_go_as_one_request_with_n_and_vote_as_before():
    with scripted_server(takes_n) as server:
        done = run_phi4(
            "solve",
            "What is 2+2?",
            "--samples",
            "4",
            "--all",
            "--backend",
            server.url,
            "-m",
            "m",
            "--seed",
            "7",
            "--json",
            timeout=100,
        )
    assert done.returncode == 0, done.stderr
    (body,) = server.bodies
    assert body["n"] == 4 and body["seed"] == 7, body  # choice i is seed 7 + i, as phi4 serve's
    record = json.loads(done.stdout)
    assert record["answer"] == "4" and record["samples_used"] == 4
    assert [s["seed"] for s in record["samples"]] == [7, 8, 9, 10]
    assert all(s["answer"] == "4" for s in record["samples"])


def refuses_n(body: dict[str, Any]) -> Iterator[str | Head]:
    if body.get("n", 1) != 1:
        yield Head(400)
        yield json.dumps({"error": {"message": "Only one completion choice is allowed"}})
        return
    yield from choices_answering(["4"])


def answers_one_choice(body: dict[str, Any]) -> Iterator[str | Step]:
    return choices_answering(["4"])  # whatever n says


@pytest.mark.parametrize(
    "server_script", [refuses_n, answers_one_choice], ids=["refuses", "ignores"]
)
def test_an_engine_that_does_not_take_n_gets_each_sample_alone_and_is_not_asked_again(
    server_script: Any, tmp_path: Path
):
    problems = tmp_path / "two.jsonl"
    problems.write_text(
        '{"problem": "What is 2+2?", "answer": "4"}\n{"problem": "What is 1+3?", "answer": "4"}\n'
    )
    results = tmp_path / "results.jsonl"
    with scripted_server(server_script) as server:
        done = run_phi4(
            "eval",
            str(problems),
            "-k",
            "3",
            "--all",
            "--backend",
            server.url,
            "-m",
            "m",
            "--backend-concurrency",
            "3",
            "-o",
            str(results),
            timeout=100,
        )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["status"] for r in records] == ["correct", "correct"]
    asked_n = [b for b in server.bodies if b.get("n", 1) != 1]
    assert len(asked_n) == 1, "found out once, with the first problem's samples, and remembered"
    answered = [b for b in server.bodies if b.get("n", 1) == 1]
    # The first problem's three asked again alone (or, when one choice came, the two it lacked),
    # the second problem's three alone from the start.
    assert len(answered) == (6 if server_script is refuses_n else 5), server.bodies


def fast_and_endless(body: dict[str, Any]) -> Iterator[str | Step]:
    """Choices 0 to 3 answer at once; the others think for ever, until the client hangs up."""
    count = int(body.get("n", 1))
    for index in range(count):
        yield piece(index, {"role": "assistant", "content": ""})
    for index in range(min(4, count)):
        yield piece(index, {"content": "\\boxed{4}"})
        yield piece(index, {}, "stop")
    while True:
        for index in range(4, count):
            yield piece(index, {"content": " and"})
        yield Step(sleep=0.02)


@pytest.mark.timeout(120)
def test_an_early_stop_hangs_the_shared_request_up():
    # Without a max_tokens the slow choices stream for ever: the run ends only because the
    # vote, settled by the first four, hangs the shared request up.
    with scripted_server(fast_and_endless) as server:
        done = run_phi4(
            "solve",
            "What is 2+2?",
            "--samples",
            "8",
            "--backend",
            server.url,
            "-m",
            "m",
            "--json",
            timeout=100,
        )
    assert done.returncode == 0, done.stderr
    (body,) = server.bodies
    assert body["n"] == 8
    record = json.loads(done.stdout)
    assert record["answer"] == "4"
    assert record["samples_used"] < 8 and any(s["cancelled"] for s in record["samples"])


def test_phi4_with_phi4_serve_asks_for_the_samples_in_one_request(tiny_model: Path):
    proc, url = start_server(tiny_model, env={"PHI4_LOOP": "off"})
    try:

        def counts() -> tuple[float, float]:
            _status, text = get(f"{url}/metrics")
            found = {}
            for line in text.splitlines():
                if line.startswith('phi4_http_requests_total{path="/v1/chat/completions"'):
                    found["requests"] = float(line.rsplit(" ", 1)[1])
                elif line.startswith("phi4_http_chat_choices_total "):
                    found["choices"] = float(line.rsplit(" ", 1)[1])
            return found.get("requests", 0.0), found.get("choices", 0.0)

        before = counts()
        done = run_phi4(
            "solve",
            "What is 12*13?",
            "--samples",
            "4",
            "--all",
            "--backend",
            f"{url}/v1",
            "-m",
            "tiny-phi3",
            "-n",
            "8",
            "--seed",
            "3",
            "--loop",
            "off",
            "--json",
        )
        after = counts()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert done.returncode in (0, 1), done.stderr  # (the tiny model states no answer)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 4), (before, after)
    record = json.loads(done.stdout)
    assert [s["seed"] for s in record["samples"]] == [3, 4, 5, 6]
    # The usage, sent after the last choice, sums the completions, so each sample counts its
    # own pieces; its prompt count is each sample's that had not ended before it (one that
    # ended while others still wrote is not held back for it: it counts 0).
    assert all(0 < s["stats"]["completion_tokens"] <= 8 for s in record["samples"])
    prompts = [s["stats"]["prompt_tokens"] for s in record["samples"]]
    assert len(set(prompts) - {0}) == 1, prompts


FLOOD_BYTES = 16 * 2**20  # of choice 0, after its sample has left it


def floods_a_left_choice(body: dict[str, Any]) -> Iterator[str | Step]:
    """Choice 0 writes on long after its sample's -n is spent (16 MiB), then the other choices
    answer: a reader that kept what choice 0 sends would hold all of it."""
    count = int(body.get("n", 1))
    for index in range(count):
        yield piece(index, {"role": "assistant", "content": ""})
    batch = "".join(piece(0, {"content": f" word{i}"}) for i in range(1000))  # no loop to catch
    for _ in range(FLOOD_BYTES // len(batch) + 1):
        yield batch
    for index in range(1, count):
        yield piece(index, {"content": "So it is \\boxed{156}."})
        yield piece(index, {}, "stop")
    yield piece(0, {}, "stop")
    yield data("[DONE]")


@pytest.mark.timeout(150)
def test_a_choice_whose_sample_left_is_dropped_not_buffered():
    # Issue 50: the sample of choice 0 stops at 50 pieces, but the shared reader queued every
    # later chunk of its choice for nobody: 16 MiB of flood took the client to 286 MiB.
    from tests.test_remote_backend import _solve_measured

    with scripted_server(floods_a_left_choice) as server:
        done, rss_kib = _solve_measured(
            server.url, "--samples", "2", "--all", "-n", "50", "--json", env={}
        )
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    (body,) = server.bodies
    assert body["n"] == 2
    record = json.loads(done.stdout)
    assert [s["answer"] for s in record["samples"]] == [None, "156"], record["samples"]
    assert rss_kib < 100 * 1024, f"peak RSS {rss_kib // 1024} MiB for a 16 MiB flood"
