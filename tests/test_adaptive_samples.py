"""--samples K is the most phi4 takes: once the vote is settled (Adaptive-Consistency's Beta
rule), the samples not finished are cancelled; --all takes all K.
The question is asked in words, so the answer checker decides none of its answers: the vote's
own rule is what stops it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from phi4cli.text.reasoning import Vote, leader_confidence, majority_vote, vote_settled
from tests.conftest import run_phi4
from tests.scripted_server import Step, scripted_server, separated


def test_the_beta_rule_is_adaptive_consistencys():
    # P(p1 > p2) for p1 ~ Beta(a + 1, b + 1): 3 of 3 agreeing is the first count over 93%.
    assert leader_confidence(3, 0) == 15 / 16
    assert leader_confidence(4, 0) == 31 / 32
    assert leader_confidence(0, 0) == 0.5
    assert leader_confidence(6, 1) > 0.95 > leader_confidence(5, 1)

    def vote(a: int, b: int, tie: bool = False) -> Vote:
        return Vote("7", a, a + b, tie, (), b)

    assert not vote_settled(vote(2, 0), left=6)
    assert vote_settled(vote(3, 0), left=5)
    assert not vote_settled(vote(3, 0), left=5, confidence=0.95), "the paper's 95%: 4 of 4"
    assert not vote_settled(vote(4, 1), left=3)
    assert vote_settled(vote(5, 1), left=4), "5 to 1: 0.9375"
    assert vote_settled(vote(4, 1), left=2), "the two left cannot change the leader"
    assert not vote_settled(vote(2, 2, tie=True), left=2)
    assert not vote_settled(Vote(None, 0, 4, False), left=4), "no answer yet"
    counted = majority_vote(["7", "8", "7", "9", "7"])
    assert (counted.votes, counted.runner_up) == (3, 1)


def _answers(fast: int) -> Any:
    """Every sample answers 7; those with seed below 100 + ``fast`` at once, the others only
    after 60 s (the run never waits for them when it stops)."""

    def script(body: dict[str, Any]) -> list[str | Step]:
        lines = separated("reasoning_content", ["Think."], ["So $\\boxed{7}$."])
        return lines if body["seed"] < 100 + fast else [Step(sleep=60.0), *lines]

    return script


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_samples_that_agree_stop_after_the_rules_minimum_and_cancel_the_rest():
    with scripted_server(_answers(fast=3)) as server:
        base = (
            "solve",
            "3 plus 4?",
            "--backend",
            server.url,
            "-m",
            "m",
            "-k",
            "8",
            "--seed",
            "100",
        )
        text = run_phi4(*base, timeout=100)
        record = json.loads(run_phi4(*base, "--json", timeout=100).stdout)
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[-1] == "Answer: 7 (3/3 samples agree, stopped after 3 of 8)"
    assert (record["answer"], record["agreement"]) == ("7", "3/3")
    assert (record["samples_asked"], record["samples_used"]) == (8, 3)
    cancelled = [s for s in record["samples"] if s["cancelled"]]
    assert len(record["samples"]) == 8 and len(cancelled) == 5
    assert all(s["error"] is None and s["answer"] is None for s in cancelled)


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_all_takes_every_sample_and_answer_only_says_where_it_stopped():
    with scripted_server(_answers(fast=8)) as server:
        base = (
            "solve",
            "3 plus 4?",
            "--backend",
            server.url,
            "-m",
            "m",
            "-k",
            "8",
            "--seed",
            "100",
        )
        every = run_phi4(*base, "--all", timeout=100)
    assert every.returncode == 0, every.stderr
    assert every.stdout.splitlines()[-1] == "Answer: 7 (8/8 samples agree)"
    with scripted_server(_answers(fast=3)) as server:
        short = run_phi4(
            "solve",
            "3 plus 4?",
            "--backend",
            server.url,
            "-m",
            "m",
            "-k",
            "8",
            "--seed",
            "100",
            "--answer-only",
            timeout=100,
        )
    assert short.returncode == 0, short.stderr
    assert short.stdout == "7\n"
    assert "phi4: 3/3 samples agree, stopped after 3 of 8" in short.stderr
    alone = run_phi4("solve", "3 plus 4?", "--all", "--backend", "http://127.0.0.1:9/v1")
    assert alone.returncode == 2 and "--all goes with --samples K" in alone.stderr


LONG = 1000  # tokens of each sample: some time for the cancel to reach the daemon


@pytest.mark.timeout(600)
@pytest.mark.daemon
def test_through_the_daemon_a_settled_vote_cancels_the_samples_still_to_come(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
):
    # The tiny model states no answer, so each solution's "answer" is read as 7 here: the
    # daemon, its socket and its cancellation are the real ones.
    import io

    from phi4cli.backends import outcome
    from phi4cli.client.environment import Environment
    from phi4cli.client.solving import SolveOptions, run_solve
    from phi4cli.core.paths import get_paths

    monkeypatch.setattr(outcome, "extract_final_answer", lambda text: "7" if text else None)
    # A context that holds one such request at a time: the samples run one after another, so
    # those after the third are still waiting in the daemon when the vote settles.
    started = run_phi4("daemon", "start", "-m", str(tiny_model), "--n-ctx", "1200")
    assert started.returncode == 0, started.stderr
    out, err = io.StringIO(), io.StringIO()
    env = Environment(io.StringIO(), out, err, paths=get_paths())
    options = SolveOptions(
        prompt="3 plus 4?",
        model=str(tiny_model),
        samples=8,
        max_tokens=LONG,
        temperature=0.0,
        as_json=True,
    )
    assert run_solve(options, env) == 0, err.getvalue()
    record = json.loads(out.getvalue())
    # Three settle it; the fourth had begun by then, and votes too if it ended before the
    # cancel reached it (a client stalled for a whole sample's time).
    used = record["samples_used"]
    assert used in (3, 4) and record["agreement"] == f"{used}/{used}", record["agreement"]
    assert record["samples_asked"] == 8
    assert sum(s["cancelled"] for s in record["samples"]) == 8 - used
    assert all(s["stats"]["completion_tokens"] > 0 for s in record["samples"] if not s["cancelled"])
    status = json.loads(run_phi4("status", "--json").stdout)
    assert status["memory"]["running"] == 0, "nothing of the cancelled samples still runs"
    # Tokens really saved: one sample at most was begun beyond those that voted.
    assert status["metrics"]["completion_tokens"] < (used + 1) * LONG, status["metrics"]


@pytest.mark.timeout(300)
@pytest.mark.daemon
def test_eval_stops_each_problems_samples_once_settled_and_says_how_many_it_used(
    tmp_path: Path,
):
    def script(body: dict[str, Any]) -> list[str | Step]:
        number = body["messages"][-1]["content"].split("\n\n")[0].removeprefix("p")
        lines = separated("reasoning_content", ["Think."], [f"$\\boxed{{{number}}}$"])
        return lines if body["seed"] < 103 else [Step(sleep=60.0), *lines]

    problems = tmp_path / "set.jsonl"
    problems.write_text(
        "".join(json.dumps({"problem": f"p{i}", "answer": str(i)}) + "\n" for i in range(4))
    )
    results = tmp_path / "out.jsonl"
    with scripted_server(script) as server:
        base = (
            "eval",
            str(problems),
            "--backend",
            server.url,
            "-m",
            "m",
            "-k",
            "8",
            "--seed",
            "100",
            "-o",
            str(results),
        )
        first = run_phi4(*base, "--json", timeout=200)
        assert first.returncode == 0, first.stderr
        summary = json.loads(first.stdout)
        assert (summary["correct"], summary["samples"], summary["mean_samples_used"]) == (4, 8, 3.0)
        assert summary["completion_tokens"] == 4 * 3 * 2, "three samples of two pieces each"
        records = [json.loads(line) for line in results.read_text().splitlines()]
        assert {(r["k"], r["samples_used"], r["agreement"]) for r in records} == {(8, 3, "3/3")}
        table = run_phi4(*base, timeout=200)
        assert "resuming: 4 of 4 problems" in table.stderr
        assert "3.0 a problem of at most 8" in table.stdout
        every = run_phi4(*base, "--all", timeout=200)
    assert every.returncode == 1
    assert "(samples stopped once settled, not all K)" in every.stderr
