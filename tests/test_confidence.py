"""A trace's confidence from the model's token probabilities (DeepConf): in the daemon from the
logits, through a server from its top_logprobs; votes weighted by it (--vote confidence)."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from phi4cli.backends.outcome import Outcome
from phi4cli.client.voting import EarlyStop
from phi4cli.core.protocol import ErrorCode, Event, EventKind, Stats
from phi4cli.text.confidence import (
    GROUP,
    LogitsConfidence,
    TraceConfidence,
    floor_from,
    from_logprobs,
)
from phi4cli.text.reasoning import AnswerComparer, majority_vote
from tests.conftest import run_phi4
from tests.scripted_server import Head, Step, data, scripted_server
from tests.test_thinking_control import ANSWER, THINKING
from tests.tinymodel import write_script_model


def test_a_tokens_confidence_is_the_negative_mean_top_k_log_probability():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(5000) * 4).astype(np.float32)
    shifted = logits.astype(np.float64) - logits.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    expected = -np.sort(logprobs)[-20:].mean()
    measure = LogitsConfidence(5000)
    assert measure(logits) == pytest.approx(expected, rel=1e-5)
    assert measure(logits + 100.0) == pytest.approx(expected, rel=1e-4)  # shift-invariant
    assert from_logprobs([-0.1, -3.0, -5.0]) == pytest.approx(2.7)
    assert from_logprobs([]) is None


def test_the_lowest_group_is_the_least_sure_stretch_and_the_mean_for_a_short_trace():
    trace = TraceConfidence(group=3)
    for value in (9.0, 9.0, 9.0, 2.0, 2.0, 2.0, 9.0):
        trace.add(value)
    assert trace.mean == pytest.approx(42 / 7) and trace.lowest_group == pytest.approx(2.0)
    short = TraceConfidence(group=3)
    short.add(4.0)
    short.add(6.0)
    assert short.lowest_group == short.mean == 5.0
    assert TraceConfidence().stats() == {
        "confidence": None,
        "lowest_group_confidence": None,
        "confidence_tokens": 0,
    }


def test_tokens_without_a_finite_confidence_are_passed_over():
    measure = LogitsConfidence(30)
    logits = np.full(30, -np.inf, dtype=np.float32)
    logits[:3] = (1.0, 2.0, 3.0)  # fewer finite logits than the top 20: infinite confidence
    trace = TraceConfidence()
    for value in (measure(logits), float("nan"), 4.0):
        trace.add(value)
    assert (trace.tokens, trace.mean) == (1, 4.0)
    small = LogitsConfidence(5)  # a vocabulary under 20: all its tokens
    assert small(np.arange(5, dtype=np.float32)) == pytest.approx(
        -np.mean(np.arange(5) - np.log(np.exp(np.arange(5)).sum()))
    )


def test_a_confidence_vote_lets_the_surer_samples_win():
    answers = ["7", "7", "9", None]
    assert majority_vote(answers, equal=str.__eq__).answer == "7"
    weighted = majority_vote(answers, equal=str.__eq__, weights=[2.0, 2.0, 9.0, 0.0])
    assert (weighted.answer, weighted.votes, weighted.runner_up) == ("9", 1, 2)
    # A weight that is not a number counts nothing; the weights are one per answer.
    assert majority_vote(["1", "2"], equal=str.__eq__, weights=[float("nan"), 1.0]).answer == "2"
    near = majority_vote(["1", "2"], equal=str.__eq__, weights=[0.1 + 0.2, 0.3])
    assert (near.answer, near.tie) == ("1", True)
    with pytest.raises(ValueError, match="1 weights for 2 answers"):
        majority_vote(["1", "2"], equal=str.__eq__, weights=[1.0])


@pytest.mark.timeout(300)
@pytest.mark.daemon
def test_the_daemon_reports_confidence_when_it_is_shown(tmp_path: Path, tiny_reasoning_model):
    scripted = write_script_model(tmp_path / "short.gguf", THINKING, ANSWER)
    sure = run_phi4("solve", "What is 2+2?", "-m", str(scripted), "-t", "0", "--json", timeout=120)
    stats = json.loads(sure.stdout)["stats"]
    # One confidence per step sampled: each token, and the end of the text.
    assert stats["confidence_tokens"] == stats["completion_tokens"] + 1
    assert stats["confidence"] is not None and stats["lowest_group_confidence"] is not None
    unsure = run_phi4(
        "solve",
        "What is 2+2?",
        "-m",
        str(tiny_reasoning_model),
        "-n",
        "64",
        "--seed",
        "1",
        "--json",
        timeout=120,
    )
    random_stats = json.loads(unsure.stdout)["stats"]
    # The scripted model is sure of each next token; the random one's are all alike.
    assert stats["confidence"] > random_stats["confidence"] + 2, (stats, random_stats)
    verbose = run_phi4(
        "solve", "What is 2+2?", "-m", str(scripted), "-t", "0", "--verbose", timeout=120
    )
    assert f"confidence:       {stats['confidence']:.2f} mean" in verbose.stderr


def _with_logprobs(
    text: str, tops: list[float], field: str = "content", finish: str | None = None
) -> str:
    return data({"id": "c1", "object": "chat.completion.chunk", "model": "m",
                 "choices": [{"index": 0, "delta": {field: text}, "finish_reason": finish,
                              "logprobs": {"content": [{"token": text, "logprob": tops[0],
                                  "top_logprobs": [{"token": "x", "logprob": v} for v in tops]}]}}]})  # fmt: skip  # noqa: E501


def _voting_server(body: dict[str, Any]) -> list[str | Step | Head]:
    """Seeds 1 and 2 say 7, unsure; seed 3 says 9, sure; logprobs only when asked."""
    tops = [-0.7, -0.9, -1.0] if body["seed"] in (1, 2) else [-0.01, -9.0, -12.0]
    answer = "7" if body["seed"] in (1, 2) else "9"
    asked = body.get("logprobs") is True and body.get("top_logprobs") == 20
    pieces = [(" Think.", "reasoning_content"), (f" $\\boxed{{{answer}}}$", "content")]
    lines: list[str | Step | Head] = []
    for text, field in pieces:
        lines.append(
            _with_logprobs(text, tops, field)
            if asked
            else data(
                {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "model": "m",
                    "choices": [{"index": 0, "delta": {field: text}, "finish_reason": None}],
                }
            )
        )
    lines += [
        data(
            {
                "id": "c1",
                "object": "chat.completion.chunk",
                "model": "m",
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            }
        ),
        data("[DONE]"),
    ]
    return lines


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_a_servers_logprobs_give_confidence_and_a_confidence_vote():
    with scripted_server(_voting_server) as server:
        base = (
            "solve",
            "3 plus 4?",
            "--backend",
            server.url,
            "-m",
            "m",
            "-k",
            "3",
            "--all",
            "--seed",
            "1",
        )
        counted = run_phi4(*base, timeout=100)
        assert not any("logprobs" in b for b in server.bodies), "not asked when not used"
        weighted = run_phi4(*base, "--vote", "confidence", "--json", timeout=100)
        assert all(b["logprobs"] is True and b["top_logprobs"] == 20 for b in server.bodies[3:])
    assert counted.stdout.splitlines()[-1] == "Answer: 7 (2/3 samples agree)"
    record = json.loads(weighted.stdout)
    assert (record["answer"], record["agreement"], record["vote"]) == ("9", "1/3", "confidence")
    confidences = sorted(s["stats"]["confidence"] for s in record["samples"])
    assert confidences == pytest.approx([0.8667, 0.8667, 7.0033], abs=1e-3)


def _no_logprobs_server(body: dict[str, Any]) -> list[str | Step | Head]:
    if "logprobs" in body:
        payload = json.dumps({"error": {"message": "logprobs is not supported with this model"}})
        return [
            Head(400, {"Content-Type": "application/json", "Content-Length": str(len(payload))}),
            payload,
        ]
    return _voting_server(body)


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_a_server_that_refuses_logprobs_is_asked_without_and_the_vote_counts():
    with scripted_server(_no_logprobs_server) as server:
        done = run_phi4(
            "solve",
            "3 plus 4?",
            "--backend",
            server.url,
            "-m",
            "m",
            "-k",
            "3",
            "--all",
            "--seed",
            "1",
            "--vote",
            "confidence",
            "--json",
            timeout=100,
        )
        asked = [b for b in server.bodies if "logprobs" in b]
    assert done.returncode == 0, done.stderr
    assert len(asked) >= 1 and len(server.bodies) - len(asked) == 3  # each answered without
    record = json.loads(done.stdout)
    assert (record["answer"], record["vote"]) == ("7", "count")
    assert all(s["stats"]["confidence"] is None for s in record["samples"])
    assert "sent no logprobs" in record["samples"][0]["stats"]["confidence_unavailable"]
    assert "gives no logprobs" in done.stderr and "the vote counts samples" in done.stderr
    assert done.stderr.count("the vote counts samples") == 1


def _graded_server(body: dict[str, Any]) -> list[str | Step | Head]:
    """p0 and p1 are answered right and sure, p2 wrong and unsure (the reference is 2)."""
    number = int(body["messages"][-1]["content"].split("\n\n")[0].removeprefix("p"))
    tops = [-0.01, -6.0, -9.0] if number < 2 else [-0.5, -0.9, -1.3]
    answer = number if number < 2 else 5
    return [
        _with_logprobs(" Think.", tops, "reasoning_content"),
        _with_logprobs(f" $\\boxed{{{answer}}}$", tops),
        _with_logprobs("", tops, finish="stop"),
        data("[DONE]"),
    ]


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_eval_records_each_answers_confidence_and_compares_right_with_wrong(tmp_path: Path):
    problems = tmp_path / "set.jsonl"
    problems.write_text(
        "".join(json.dumps({"problem": f"p{i}", "answer": str(i)}) + "\n" for i in range(3))
    )
    results = tmp_path / "out.jsonl"
    with scripted_server(_graded_server) as server:
        # --vote confidence asks for it (with one sample, nothing is voted on).
        done = run_phi4(
            "eval",
            str(problems),
            "--backend",
            server.url,
            "-m",
            "m",
            "-o",
            str(results),
            "--json",
            "--vote",
            "confidence",
            timeout=100,
        )
        table = run_phi4(
            "eval",
            str(problems),
            "--backend",
            server.url,
            "-m",
            "m",
            "-o",
            str(tmp_path / "again.jsonl"),
            "--vote",
            "confidence",
            timeout=100,
        )
        plain = run_phi4(
            "eval",
            str(problems),
            "--backend",
            server.url,
            "-m",
            "m",
            "-o",
            str(tmp_path / "plain.jsonl"),
            "--json",
            timeout=100,
        )
        assert not any("logprobs" in body for body in server.bodies[-3:])
    assert "mean_confidence" not in json.loads(plain.stdout)
    summary = json.loads(done.stdout)
    assert (summary["correct"], summary["wrong"]) == (2, 1), done.stderr
    assert summary["mean_confidence"] == pytest.approx({"correct": 5.0033, "wrong": 0.9}, abs=1e-3)
    records = sorted(
        (json.loads(line) for line in results.read_text().splitlines()), key=lambda r: r["line"]
    )  # (written as each is judged)
    assert [round(r["confidence"], 2) for r in records] == [5.0, 5.0, 0.9]
    assert "confidence  5.00 right, 0.90 wrong" in table.stdout


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_a_refusal_of_logprobs_after_busy_answers_does_not_spend_the_retries():
    asked: list[dict[str, Any]] = []

    def busy_then_strict(body: dict[str, Any]) -> list[str | Step | Head]:
        asked.append(body)
        if len(asked) <= 3:  # three 429s: every retry a busy server is given
            return [Head(429, {"Retry-After": "0", "Content-Length": "4"}), "busy"]
        return _no_logprobs_server(body)

    with scripted_server(busy_then_strict) as server:
        done = run_phi4(
            "solve",
            "3 plus 4?",
            "--backend",
            server.url,
            "-m",
            "m",
            "--seed",
            "1",
            "--json",
            timeout=100,
        )
    assert done.returncode == 0, done.stderr
    assert ["logprobs" in b for b in asked] == [True, True, True, True, False]
    assert json.loads(done.stdout)["answer"] == "7"


# --- DeepConf online: --stop-unsure ---------------------------------------------------------------


def test_the_floor_is_the_warm_up_traces_lower_quantile():
    assert floor_from([]) is None
    assert floor_from([5.0]) == 5.0
    # The 10th percentile, linear between the nearest two (numpy's default).
    assert floor_from([10.0, 14.0, 12.0]) == pytest.approx(10.4)
    assert floor_from([10.0, 14.0, 12.0], keep=0.5) == pytest.approx(12.0)
    assert floor_from([float("nan"), 3.0, float("inf")]) == 3.0


def test_a_traces_window_is_tested_against_the_floor_only_once_it_is_full():
    trace = TraceConfidence(group=3)
    for value in (9.0, 1.0):
        trace.add(value)
    assert trace.window is None and not trace.below(100.0)  # two tokens: not a window yet
    trace.add(2.0)
    assert trace.window == pytest.approx(4.0)
    assert trace.below(4.5) and not trace.below(4.0) and not trace.below(None)
    trace.add(9.0)  # the window slides: 1, 2, 9
    assert trace.window == pytest.approx(4.0)


def _sample(answer: str | None, confidence: float | None, finish: str = "stop") -> Outcome:
    outcome = Outcome(index=0, question="q")
    if answer is not None:
        outcome.apply(Event(EventKind.TOKEN, text=f"\\boxed{{{answer}}}"))
    outcome.apply(Event.of_stats(Stats(lowest_group_confidence=confidence, finish_reason=finish)))
    outcome.apply(Event(EventKind.DONE))
    return outcome


def test_the_first_samples_set_the_floor_and_an_unsure_one_does_not_vote():
    adjusted: list[tuple[int, float]] = []
    cancelled: list[int] = []
    stop = EarlyStop(
        6, AnswerComparer(), cancelled.append, lambda k, params: adjusted.append((k, params))
    )
    stop.end(0, _sample("7", 12.0))
    stop.end(1, _sample("8", 10.0))
    assert adjusted == [] and stop.floor is None
    stop.end(3, _sample("7", 14.0))  # the third to end sets the floor for those still running
    assert stop.floor == pytest.approx(10.4)
    assert adjusted == [(k, stop.floor) for k in (2, 4, 5)]
    unsure = _sample("8", 9.0, finish="unsure")
    assert unsure.unsure and unsure.answer is None  # cut short: it states no answer
    stop.end(2, unsure)
    assert stop.unsure == {2} and stop.answers == ["7", "8", "7"] and not cancelled
    # Without adjust (--stop-unsure off) nothing is set.
    plain = EarlyStop(6, AnswerComparer(), None)
    for k, c in enumerate((12.0, 10.0, 14.0)):
        plain.end(k, _sample("7", c))
    assert plain.floor is None


@pytest.mark.timeout(300)
@pytest.mark.daemon
def test_the_daemon_stops_a_request_whose_confidence_falls_below_its_floor(
    tmp_path: Path, phi4_home: Path
):
    loops = write_script_model(tmp_path / "loops.gguf", THINKING, ANSWER, loops=True)
    assert run_phi4("daemon", "start", "-m", str(loops), "--n-ctx", "8192").returncode == 0

    def send(sock: socket.socket, request_id: int, op: str, **params: object) -> None:
        request = {"v": 1, "id": request_id, "op": op, "params": params}
        sock.sendall(json.dumps(request).encode() + b"\n")

    solve = {"prompt": "What is 2+2?", "temperature": 0, "max_tokens": GROUP + 600, "loop": "off"}
    ends: dict[int, dict[str, Any]] = {}
    stats: dict[int, dict[str, Any]] = {}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(phi4_home / "run" / "daemon.sock"))
        reader = sock.makefile("rb")
        # 1: a floor set by adjust after it was sent (every confidence is below 1e9); 3: a
        # floor in the request that it never falls below (a confidence is never negative); 5:
        # an adjust that makes no sense is refused, and the daemon goes on.
        send(sock, 1, "solve", confidence=True, **solve)
        send(sock, 2, "adjust", target=1, confidence_floor=1e9)
        send(sock, 3, "solve", confidence_floor=0.0, **solve)
        send(sock, 4, "adjust", target=99, confidence_floor=1.0)
        send(sock, 5, "adjust", target=3, confidence_floor="high")
        deadline = time.monotonic() + 200
        while len(ends) < 5 and time.monotonic() < deadline:
            event = json.loads(reader.readline())
            if event["event"] == "stats":
                stats[event["id"]] = event
            elif event["event"] in ("done", "error"):
                ends[event["id"]] = event
    assert ends[2]["result"] == {"adjusted": True} and ends[4]["result"] == {"adjusted": False}
    assert (ends[5]["code"], ends[5]["message"]) == (
        "bad_request",
        "'confidence_floor' must be a number, or null",
    )
    # Stopped as soon as a whole window of steps was below the floor (the window's last step
    # is the one that would have sampled the next token), not at max_tokens.
    assert stats[1]["finish_reason"] == "unsure", stats[1]
    assert stats[1]["confidence_tokens"] == GROUP == stats[1]["completion_tokens"] + 1
    assert (stats[3]["finish_reason"], stats[3]["completion_tokens"]) == ("length", GROUP + 600)
    assert stats[3]["confidence"] is not None  # the floor asked for the confidence


def _unsure_server(release: threading.Event) -> Any:
    """Seeds 1 and 3 answer 7, seed 2 answers 8, each sure and short; the others answer 8 after
    a long unsure thinking: GROUP + 50 tokens, then a token every 20 ms until the client hangs
    up or ``release`` is set (or a minute passes), then the answer."""

    def script(body: dict[str, Any]) -> Any:
        seed = body["seed"]
        if seed <= 3:
            tops = [-0.01, -6.0, -9.0]
            yield _with_logprobs(" Think.", tops, "reasoning_content")
            yield _with_logprobs(f" $\\boxed{{{7 if seed != 2 else 8}}}$", tops)
        else:
            tops = [-0.5, -0.9, -1.3]
            for _ in range(GROUP + 50):
                yield _with_logprobs(" hmm", tops, "reasoning_content")
            deadline = time.monotonic() + 60
            while not release.is_set() and time.monotonic() < deadline:
                yield Step(sleep=0.02)
                yield _with_logprobs(" hmm", tops, "reasoning_content")
            yield _with_logprobs(" $\\boxed{8}$", tops)
        yield _with_logprobs("", [-0.01], finish="stop")
        yield data("[DONE]")

    return script


@pytest.mark.timeout(200)
@pytest.mark.parametrize("concurrency", [1, 6])
@pytest.mark.daemon
def test_samples_less_sure_than_the_first_are_stopped_and_do_not_vote(concurrency: int):
    release = threading.Event()
    with scripted_server(_unsure_server(release)) as server:
        # (--loop off: the long thinking repeats itself, and would be ended as a loop.)
        base = (
            "solve",
            "3 plus 4?",
            "--backend",
            server.url,
            "-m",
            "m",
            "-k",
            "6",
            "--seed",
            "1",
            "--backend-concurrency",
            str(concurrency),
            "--loop",
            "off",
        )
        done = run_phi4(*base, "--stop-unsure", "--json", timeout=150)
        release.set()  # (a sample not stopped answers now, rather than in a minute)
        bodies = list(server.bodies)
        plain = run_phi4(*base, timeout=150)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    # 1 to 3 set the floor; 4 to 6 — sent with it one after another, or running when it was
    # set — fell below it, were cut short and did not vote: 7 wins, 2 of the 3 that voted.
    assert record["answer"] == "7", record
    assert [s["unsure"] for s in record["samples"]] == [False] * 3 + [True] * 3
    assert all(s["stats"]["finish_reason"] == "unsure" for s in record["samples"][3:])
    first = sorted(s["stats"]["lowest_group_confidence"] for s in record["samples"][:3])
    assert record["confidence_floor"] == pytest.approx(first[0] + 0.2 * (first[1] - first[0]))
    assert not any("confidence_floor" in b for b in bodies)  # phi4's own: never sent
    # Without it the long samples answer 8 and win.
    assert plain.stdout.splitlines()[-1].startswith("Answer: 8 (4/6 samples agree"), plain.stdout


@pytest.mark.timeout(200)
@pytest.mark.daemon
def test_eval_counts_the_samples_stopped_as_unsure(tmp_path: Path):
    problems = tmp_path / "set.jsonl"
    problems.write_text(json.dumps({"problem": "3 plus 4?", "answer": "7"}) + "\n")
    release = threading.Event()
    with scripted_server(_unsure_server(release)) as server:
        base = (
            "eval",
            str(problems),
            "--backend",
            server.url,
            "-m",
            "m",
            "-k",
            "6",
            "--seed",
            "1",
            "--backend-concurrency",
            "1",
            "--loop",
            "off",
            "--stop-unsure",
        )
        done = run_phi4(*base, "-o", str(tmp_path / "a.jsonl"), "--json", timeout=150)
        table = run_phi4(*base, "-o", str(tmp_path / "b.jsonl"), timeout=150)
        release.set()
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["correct"], summary["samples_unsure"]) == (1, 3), summary
    record = json.loads((tmp_path / "a.jsonl").read_text())
    assert (record["samples_unsure"], record["run"]["stop_unsure"]) == (3, True)
    assert "3 stopped as unsure" in table.stdout


def test_a_failed_sample_sets_no_floor_and_an_unsure_one_is_counted_even_once_cancelled():
    adjusted: list[int] = []
    stop = EarlyStop(6, AnswerComparer(), lambda k: None, lambda k, params: adjusted.append(k))
    failed = _sample(None, 1.0)
    failed.fail(ErrorCode.MODEL_ERROR, "boom")
    stop.end(0, failed)
    stop.end(1, _sample("7", 12.0))
    stop.end(2, _sample("8", 10.0))
    assert stop.floor is None and stop.warmup == [12.0, 10.0]  # the failure's trace not counted
    stop.stopped.add(3)  # cancelled as the vote settled, but it ended unsure before that arrived
    stop.end(3, _sample("8", 9.0, finish="unsure"))
    assert stop.unsure == {3} and 3 not in stop.stopped
