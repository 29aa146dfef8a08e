"""Confidence that stays finite whatever a server's logprobs, and strict JSON out (--json,
--jsonl, eval's results file)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from phi4cli.confidence import MAX_CONFIDENCE, TraceConfidence, from_logprobs
from phi4cli.solving import json_text
from tests.conftest import run_phi4
from tests.scripted_server import Head, Step, data, scripted_server
from tests.test_confidence import _with_logprobs


def _strict(text: str) -> Any:
    """``text`` parsed as strict JSON: NaN, Infinity and -Infinity are refused."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_a_tokens_confidence_is_finite_and_bounded_for_any_finite_logprobs():
    assert from_logprobs([-1e308] * 20) == MAX_CONFIDENCE
    assert from_logprobs([-1e308, -0.5]) == pytest.approx((MAX_CONFIDENCE + 0.5) / 2)
    assert from_logprobs([-1e308, -1e308]) == MAX_CONFIDENCE  # (their sum is -inf)
    assert from_logprobs([-5e-324, -0.0]) == pytest.approx(0.0)
    assert from_logprobs([3.0, -1.0]) == pytest.approx(0.5)  # a log-probability above 0 is 0
    assert from_logprobs([-0.1, -3.0, -5.0]) == pytest.approx(2.7)  # ordinary ones unchanged
    rng = random.Random(5)
    for _ in range(2000):
        values = [-(10 ** rng.uniform(-300, 308)) for _ in range(rng.randint(1, 20))]
        confidence = from_logprobs(values)
        assert confidence is not None and 0 <= confidence <= MAX_CONFIDENCE, values


def test_a_traces_sums_stay_finite_with_huge_token_confidences():
    trace = TraceConfidence(group=4)
    for value in (1e308, 1e308, 2.0, 1.7e308, 1e308, 1e308, 3.0, 3.0, 3.0, 3.0):
        trace.add(value)
    assert trace.tokens == 10
    assert trace.mean == pytest.approx((5 * MAX_CONFIDENCE + 14.0) / 10)
    assert trace.lowest_group == pytest.approx(3.0)  # the last four: the window sheds the rest
    assert trace.window == pytest.approx(3.0)
    stats = trace.stats()
    assert all(math.isfinite(v) for v in stats.values() if v is not None), stats
    again = TraceConfidence(group=3)
    for value in (1e308, 1e308):  # shorter than a window: the lowest group is the mean
        again.add(value)
    assert again.lowest_group == again.mean == MAX_CONFIDENCE


def test_json_output_writes_a_number_that_is_not_finite_as_null():
    record = {"a": float("nan"), "b": [1.5, float("inf")], "c": {"d": float("-inf")}, "e": "x"}
    assert _strict(json_text(record)) == {"a": None, "b": [1.5, None], "c": {"d": None},
                                          "e": "x"}  # fmt: skip


def _huge_logprobs(body: dict[str, Any]) -> list[str | Step | Head]:
    """Every token's top logprobs are -1e308 and -0.01: each token's confidence 5e307 as a plain
    mean, so a few of them sum past the largest float."""
    tops = [-1e308, -0.01]
    return [_with_logprobs(" Think", tops, "reasoning_content"),
            _with_logprobs(" more.", tops, "reasoning_content"),
            _with_logprobs("So ", tops), _with_logprobs("$\\boxed{7}$", tops),
            _with_logprobs(".", tops), _with_logprobs("", tops, finish="stop"),
            data("[DONE]")]  # fmt: skip


@pytest.mark.timeout(200)
def test_huge_logprobs_give_a_finite_confidence_and_strict_json(tmp_path: Path):
    problems = tmp_path / "set.jsonl"
    problems.write_text(json.dumps({"problem": "What is 3+4?", "answer": "7"}) + "\n")
    lines = tmp_path / "lines.txt"
    lines.write_text("What is 3+4?\n")
    results = tmp_path / "out.jsonl"
    with scripted_server(_huge_logprobs) as server:
        base = ("--backend", server.url, "-m", "m", "--seed", "1", "--loop", "off")
        one = run_phi4("solve", "What is 3+4?", *base, "--json", timeout=60)
        voted = run_phi4("solve", "What is 3+4?", *base, "-k", "3", "--all", "--vote",
                         "confidence", "--json", timeout=60)  # fmt: skip
        each = run_phi4("solve", "-f", str(lines), "--jsonl", *base, "--verbose",
                        timeout=60)  # fmt: skip
        graded = run_phi4("eval", str(problems), *base, "-o", str(results), "--json",
                          "--vote", "confidence", timeout=60)  # fmt: skip
    for done in (one, voted, each, graded):
        assert done.returncode == 0, done.stderr
    expected = pytest.approx((MAX_CONFIDENCE + 0.01) / 2)
    stats = _strict(one.stdout)["stats"]
    assert stats["confidence"] == stats["lowest_group_confidence"] == expected, stats
    vote = _strict(voted.stdout)
    assert (vote["answer"], vote["vote"]) == ("7", "confidence")
    assert all(s["stats"]["confidence"] == expected for s in vote["samples"])
    assert _strict(each.stdout)["answer"] == "7"
    record = _strict(results.read_text())
    assert (record["status"], record["confidence"]) == ("correct", expected)
    assert _strict(graded.stdout)["mean_confidence"]["correct"] == expected
