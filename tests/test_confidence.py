"""A trace's confidence from the model's token probabilities (DeepConf): in the daemon from the
logits, through a server from its top_logprobs; votes weighted by it (--vote confidence)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from phi4cli.confidence import LogitsConfidence, TraceConfidence, from_logprobs
from phi4cli.reasoning import majority_vote
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
    assert TraceConfidence().stats() == {"confidence": None, "lowest_group_confidence": None,
                                         "confidence_tokens": 0}  # fmt: skip


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
def test_the_daemon_reports_confidence_when_it_is_shown(tmp_path: Path, tiny_reasoning_model):
    scripted = write_script_model(tmp_path / "short.gguf", THINKING, ANSWER)
    sure = run_phi4("solve", "What is 2+2?", "-m", str(scripted), "-t", "0", "--json",
                    timeout=120)  # fmt: skip
    stats = json.loads(sure.stdout)["stats"]
    # One confidence per step sampled: each token, and the end of the text.
    assert stats["confidence_tokens"] == stats["completion_tokens"] + 1
    assert stats["confidence"] is not None and stats["lowest_group_confidence"] is not None
    unsure = run_phi4("solve", "What is 2+2?", "-m", str(tiny_reasoning_model), "-n", "64",
                      "--seed", "1", "--json", timeout=120)  # fmt: skip
    random_stats = json.loads(unsure.stdout)["stats"]
    # The scripted model is sure of each next token; the random one's are all alike.
    assert stats["confidence"] > random_stats["confidence"] + 2, (stats, random_stats)
    verbose = run_phi4("solve", "What is 2+2?", "-m", str(scripted), "-t", "0", "--verbose",
                       timeout=120)  # fmt: skip
    assert f"confidence:       {stats['confidence']:.2f} mean" in verbose.stderr


def _with_logprobs(text: str, tops: list[float], field: str = "content",
                   finish: str | None = None) -> str:  # fmt: skip
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
        lines.append(_with_logprobs(text, tops, field) if asked else
                     data({"id": "c1", "object": "chat.completion.chunk", "model": "m",
                           "choices": [{"index": 0, "delta": {field: text},
                                        "finish_reason": None}]}))  # fmt: skip
    lines += [data({"id": "c1", "object": "chat.completion.chunk", "model": "m",
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
              data("[DONE]")]  # fmt: skip
    return lines


@pytest.mark.timeout(120)
def test_a_servers_logprobs_give_confidence_and_a_confidence_vote():
    with scripted_server(_voting_server) as server:
        base = ("solve", "What is 3+4?", "--backend", server.url, "-m", "m", "-k", "3", "--all",
                "--seed", "1")  # fmt: skip
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
        return [Head(400, {"Content-Type": "application/json",
                           "Content-Length": str(len(payload))}), payload]  # fmt: skip
    return _voting_server(body)


@pytest.mark.timeout(120)
def test_a_server_that_refuses_logprobs_is_asked_without_and_the_vote_counts():
    with scripted_server(_no_logprobs_server) as server:
        done = run_phi4("solve", "What is 3+4?", "--backend", server.url, "-m", "m", "-k", "3",
                        "--all", "--seed", "1", "--vote", "confidence", "--json",
                        timeout=100)  # fmt: skip
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
    return [_with_logprobs(" Think.", tops, "reasoning_content"),
            _with_logprobs(f" $\\boxed{{{answer}}}$", tops),
            _with_logprobs("", tops, finish="stop"), data("[DONE]")]  # fmt: skip


@pytest.mark.timeout(120)
def test_eval_records_each_answers_confidence_and_compares_right_with_wrong(tmp_path: Path):
    problems = tmp_path / "set.jsonl"
    problems.write_text("".join(json.dumps({"problem": f"p{i}", "answer": str(i)}) + "\n"
                                for i in range(3)))  # fmt: skip
    results = tmp_path / "out.jsonl"
    with scripted_server(_graded_server) as server:
        # --vote confidence asks for it (with one sample, nothing is voted on).
        done = run_phi4("eval", str(problems), "--backend", server.url, "-m", "m", "-o",
                        str(results), "--json", "--vote", "confidence", timeout=100)  # fmt: skip
        table = run_phi4("eval", str(problems), "--backend", server.url, "-m", "m", "-o",
                         str(tmp_path / "again.jsonl"), "--vote", "confidence",
                         timeout=100)  # fmt: skip
        plain = run_phi4("eval", str(problems), "--backend", server.url, "-m", "m", "-o",
                         str(tmp_path / "plain.jsonl"), "--json", timeout=100)  # fmt: skip
        assert not any("logprobs" in body for body in server.bodies[-3:])
    assert "mean_confidence" not in json.loads(plain.stdout)
    summary = json.loads(done.stdout)
    assert (summary["correct"], summary["wrong"]) == (2, 1), done.stderr
    assert summary["mean_confidence"] == pytest.approx({"correct": 5.0033, "wrong": 0.9},
                                                       abs=1e-3)  # fmt: skip
    records = sorted((json.loads(line) for line in results.read_text().splitlines()),
                     key=lambda r: r["line"])  # (written as each is judged)  # fmt: skip
    assert [round(r["confidence"], 2) for r in records] == [5.0, 5.0, 0.9]
    assert "confidence  5.00 right, 0.90 wrong" in table.stdout


@pytest.mark.timeout(120)
def test_a_refusal_of_logprobs_after_busy_answers_does_not_spend_the_retries():
    asked: list[dict[str, Any]] = []

    def busy_then_strict(body: dict[str, Any]) -> list[str | Step | Head]:
        asked.append(body)
        if len(asked) <= 3:  # three 429s: every retry a busy server is given
            return [Head(429, {"Retry-After": "0", "Content-Length": "4"}), "busy"]
        return _no_logprobs_server(body)

    with scripted_server(busy_then_strict) as server:
        done = run_phi4("solve", "What is 3+4?", "--backend", server.url, "-m", "m", "--seed",
                        "1", "--json", timeout=100)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert ["logprobs" in b for b in asked] == [True, True, True, True, False]
    assert json.loads(done.stdout)["answer"] == "7"
