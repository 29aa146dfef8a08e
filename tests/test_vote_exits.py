"""What `solve --samples K` says and exits with when its vote has no answer, what it claims of
the vote, what a cancelled sample shows in --json; confidence that stays finite whatever a
server's logprobs, and strict JSON out (--json, --jsonl, eval's results file). The question is
asked in words, so the answer checker decides none of its answers."""

from __future__ import annotations

import json
import math
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from phi4cli.client.solve_job import json_text
from phi4cli.text.confidence import MAX_CONFIDENCE, TraceConfidence, from_logprobs
from tests.conftest import run_phi4
from tests.scripted_server import Head, Step, data, scripted_server
from tests.test_confidence import _with_logprobs


def _strict(text: str) -> Any:
    """``text`` parsed as strict JSON: NaN, Infinity and -Infinity are refused."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _piece(text: str, field: str = "content", finish: str | None = None) -> str:
    return data(
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "model": "m",
            "choices": [{"index": 0, "delta": {field: text}, "finish_reason": finish}],
        }
    )


def _unstated(body: dict[str, Any]) -> list[str | Step | Head]:
    """Every sample thinks and writes a solution that states no final answer; no logprobs,
    asked for or not (as a server without them does)."""
    return [
        _piece(" Think.", "reasoning_content"),
        _piece("It is between 6 and 8."),
        _piece("", finish="stop"),
        data("[DONE]"),
    ]


def _unstated_but_sure(body: dict[str, Any]) -> list[str | Step | Head]:
    """As :func:`_unstated`, each token with its logprobs: confidences, and no answer to weigh."""
    tops = [-0.01, -6.0, -9.0]
    return [
        _with_logprobs(" Think.", tops, "reasoning_content"),
        _with_logprobs("It is between 6 and 8.", tops),
        _with_logprobs("", tops, finish="stop"),
        data("[DONE]"),
    ]


NO_ANSWER = (
    "phi4: no final answer: none of the 3 samples stated one (as \\boxed{...} or "
    '"the final answer is"): ask again, or with more --samples'
)


@pytest.mark.timeout(200)
@pytest.mark.daemon
def test_a_vote_without_any_answer_exits_1_with_one_line_in_every_output_mode():
    with scripted_server(_unstated) as server:
        base = (
            "solve",
            "3 plus 4?",
            "--backend",
            server.url,
            "-m",
            "m",
            "-k",
            "3",
            "--seed",
            "1",
            "--loop",
            "off",
        )
        plain = run_phi4(*base, timeout=60)
        only = run_phi4(*base, "-a", timeout=60)
        record = run_phi4(*base, "--json", timeout=60)
        every = run_phi4(*base, "--all", "-a", timeout=60)
    for done in (plain, only, record, every):
        assert done.returncode == 1, (done.stdout, done.stderr)
        assert done.stderr.splitlines() == [NO_ANSWER], done.stderr
    assert plain.stdout.splitlines() == [
        "It is between 6 and 8.",
        "Answer: (none) (0/3 samples agree)",
    ]
    assert only.stdout == every.stdout == "\n"  # a line, as one question's -a prints
    parsed = _strict(record.stdout)
    assert (parsed["answer"], parsed["agreement"]) == (None, "0/3")
    assert [s["answer"] for s in parsed["samples"]] == [None] * 3


@pytest.mark.timeout(200)
def test_at_a_terminal_a_vote_without_any_answer_says_why_and_exits_1(
    monkeypatch: pytest.MonkeyPatch,
):
    import io

    from phi4cli.client.environment import Environment
    from phi4cli.client.solving import SolveOptions, run_solve

    monkeypatch.setenv("TERM", "xterm")
    out, err = io.StringIO(), io.StringIO()
    env = Environment(
        io.StringIO(), out, err, stdout_isatty=True, stderr_isatty=False, colour=False
    )
    with scripted_server(_unstated) as server:
        options = SolveOptions(
            prompt="3 plus 4?", model="m", samples=3, backend=[server.url], seed=1, loop="off"
        )
        assert run_solve(options, env) == 1, err.getvalue()
    shown = " ".join(out.getvalue().split())  # (rich wraps the line to its width)
    assert NO_ANSWER.removeprefix("phi4: ") + " (0/3 samples agree)" in shown, shown


@pytest.mark.timeout(200)
@pytest.mark.parametrize("script", [_unstated, _unstated_but_sure])
@pytest.mark.daemon
def test_a_vote_says_weighted_by_confidence_only_where_a_confidence_weighed(script: Any):
    with scripted_server(script) as server:
        base = (
            "solve",
            "3 plus 4?",
            "--backend",
            server.url,
            "-m",
            "m",
            "-k",
            "3",
            "--seed",
            "1",
            "--loop",
            "off",
            "--vote",
            "confidence",
        )
        plain = run_phi4(*base, timeout=60)
        record = run_phi4(*base, "--json", timeout=60)
    # No sample stated an answer (and the first server sent no logprobs): nothing was weighed.
    assert plain.stdout.splitlines()[-1] == "Answer: (none) (0/3 samples agree)", plain.stdout
    assert "weighted" not in plain.stdout + plain.stderr
    parsed = _strict(record.stdout)
    assert parsed["vote"] == "count"
    confidences = [s["stats"]["confidence"] for s in parsed["samples"]]
    assert confidences == (
        [None] * 3 if script is _unstated else [pytest.approx(5.0033, abs=1e-3)] * 3
    )


def _partly_cancelled(release: threading.Event) -> Any:
    """Seeds 1 to 3 answer 7 after a moment; the others write \\boxed{9} at once and go on
    writing until the client hangs up (or ``release`` is set, or a minute passes)."""

    def script(body: dict[str, Any]) -> Any:
        yield _piece(" Think.", "reasoning_content")
        if body["seed"] <= 3:
            yield Step(sleep=0.5)
            yield _piece("So $\\boxed{7}$.")
        else:
            yield _piece("First $\\boxed{9}$, let me check")
            deadline = time.monotonic() + 60
            while not release.is_set() and time.monotonic() < deadline:
                yield Step(sleep=0.02)
                yield _piece(" and check")
        yield _piece("", finish="stop")
        yield data("[DONE]")

    return script


@pytest.mark.timeout(200)
@pytest.mark.daemon
def test_a_sample_cancelled_by_the_early_stop_shows_no_answer_in_json():
    release = threading.Event()
    try:
        with scripted_server(_partly_cancelled(release)) as server:
            done = run_phi4(
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
                "--loop",
                "off",
                "--json",
                timeout=90,
            )
            release.set()
    finally:
        release.set()
    assert done.returncode == 0, done.stderr
    record = _strict(done.stdout)
    assert (record["answer"], record["agreement"], record["samples_used"]) == ("7", "3/3", 3)
    samples = record["samples"]
    assert [s["cancelled"] for s in samples] == [False] * 3 + [True] * 3, samples
    # They had written \boxed{9} when they were cut off: not an answer of theirs.
    assert [s["answer"] for s in samples] == ["7"] * 3 + [None] * 3
    assert all(s["error"] is None for s in samples)


# --- confidence that stays finite, and strict JSON -----------------------------------------------


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
    assert _strict(json_text(record)) == {"a": None, "b": [1.5, None], "c": {"d": None}, "e": "x"}


def _huge_logprobs(body: dict[str, Any]) -> list[str | Step | Head]:
    """Every token's top logprobs are -1e308 and -0.01: each token's confidence 5e307 as a plain
    mean, so a few of them sum past the largest float."""
    tops = [-1e308, -0.01]
    return [
        _with_logprobs(" Think", tops, "reasoning_content"),
        _with_logprobs(" more.", tops, "reasoning_content"),
        _with_logprobs("So ", tops),
        _with_logprobs("$\\boxed{7}$", tops),
        _with_logprobs(".", tops),
        _with_logprobs("", tops, finish="stop"),
        data("[DONE]"),
    ]


@pytest.mark.timeout(200)
@pytest.mark.daemon
def test_huge_logprobs_give_a_finite_confidence_and_strict_json(tmp_path: Path):
    problems = tmp_path / "set.jsonl"
    problems.write_text(json.dumps({"problem": "3 plus 4?", "answer": "7"}) + "\n")
    lines = tmp_path / "lines.txt"
    lines.write_text("3 plus 4?\n")
    results = tmp_path / "out.jsonl"
    with scripted_server(_huge_logprobs) as server:
        base = ("--backend", server.url, "-m", "m", "--seed", "1", "--loop", "off")
        one = run_phi4("solve", "3 plus 4?", *base, "--json", timeout=60)
        voted = run_phi4(
            "solve",
            "3 plus 4?",
            *base,
            "-k",
            "3",
            "--all",
            "--vote",
            "confidence",
            "--json",
            timeout=60,
        )
        each = run_phi4("solve", "-f", str(lines), "--jsonl", *base, "--verbose", timeout=60)
        graded = run_phi4(
            "eval",
            str(problems),
            *base,
            "-o",
            str(results),
            "--json",
            "--vote",
            "confidence",
            timeout=60,
        )
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


def _two_fail_after_a_wrong_answer(body: dict[str, Any]) -> list[str | Step | Head]:
    """Seeds 100 and 101 write \\boxed{9} and then fail (an error mid-answer, not one to send
    again); seed 102 answers 7."""
    if body["seed"] == 102:
        return [_piece("So $\\boxed{7}$."), _piece("", finish="stop"), data("[DONE]")]
    error = {"error": {"message": "the engine broke", "code": 400}}
    return [_piece("So $\\boxed{9}$."), data(error), data("[DONE]")]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("command", ["solve", "eval"])
@pytest.mark.daemon
def test_a_failed_sample_does_not_vote_with_what_it_wrote_before_it_failed(
    command: str, tmp_path: Path
):
    # Before: the two failed samples' \boxed{9} outvoted the one that answered 7, though the
    # command said the failed samples were not counted.
    with scripted_server(_two_fail_after_a_wrong_answer) as server:
        common = ("--backend", server.url, "-m", "m", "-k", "3", "--all", "--seed", "100")
        if command == "solve":
            done = run_phi4("solve", "3 plus 4?", *common, "--json", timeout=100)
            record = _strict(done.stdout)
            assert "2 of 3 samples failed and are not counted" in done.stderr
        else:
            problems = tmp_path / "p.jsonl"
            problems.write_text(json.dumps({"problem": "3 plus 4?", "answer": "7"}) + "\n")
            results = tmp_path / "r.jsonl"
            done = run_phi4("eval", str(problems), *common, "-o", str(results), timeout=100)
            record = _strict(results.read_text().splitlines()[0])
            assert record["samples"] == [None, None, "7"]
            assert [d["answer"] for d in record["sample_details"]] == [None, None, "7"]
    assert record["answer"] == "7", (done.stderr, record.get("samples"))
