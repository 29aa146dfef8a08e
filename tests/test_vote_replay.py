"""Votes replayed offline: `eval -k K` records each sample (answer, tokens, when it ended, its
confidence, loop), and bench/votes.py feeds them to the CLI's own early stop in the order they
ended, a cancelled sample paying for the tokens it had written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_phi4
from tests.scripted_server import Step, scripted_server, separated

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from votes import Sample, replay  # noqa: E402


def test_the_clis_early_stop_replayed_in_finishing_order_pays_for_what_cancelled_samples_wrote():
    # 4 at a time: samples 0-2 end at 1, 2 and 3 s saying 7 (settled: 3 of 3), 3 began at 0 and
    # is 30% through, 4 and 5 began when 0 and 1 ended, 6 at 3 s, 7 had not begun.
    samples = [
        Sample("7", 100, 0.0, 1.0),
        Sample("7", 100, 0.0, 2.0),
        Sample("7", 100, 0.0, 3.0),
        Sample("8", 1000, 0.0, 10.0),
        Sample("8", 1000, 1.0, 11.0),
        Sample("8", 1000, 2.0, 12.0),
        Sample("8", 1000, 3.0, 13.0),
        Sample("8", 1000, 10.0, 20.0),
    ]
    row = replay(samples, str.__eq__)
    assert (row.answer, row.used, row.full, row.tie) == ("7", 3, "8", False)
    assert (row.tokens, row.full_tokens) == (300 + 300 + 200 + 100, 5300)
    # Answers that alternate never settle: all are paid for, all vote, and the full vote ties.
    even = [Sample("7" if i % 2 else "8", 100, 0.0, i + 1.0) for i in range(8)]
    row = replay(even, str.__eq__)
    assert (row.used, row.tokens, row.full_tokens, row.tie) == (8, 800, 800, True)


def test_a_replay_with_stop_unsure_sets_the_floor_the_cli_would(tmp_path: Path):
    # The CLI's early stop hands its adjust a floor (a float): the bench's replay takes it so.
    confident = [Sample("7", 100, 0.0, 1.0 + i, confidence=10.0 - i) for i in range(8)]
    row = replay(confident, str.__eq__, stop_unsure=True)
    assert row.answer == "7"
    command = [
        sys.executable,
        str(ROOT / "bench" / "votes.py"),
        "simulate",
        "--problems",
        "20",
        "--k",
        "8",
        "--seeds",
        "1",
        "--stop-unsure",
        "--out",
        str(tmp_path),
    ]
    simulated = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert simulated.returncode == 0, simulated.stderr
    assert "AIME-like" in simulated.stdout


def _script(body: dict[str, Any]) -> list[str | Step]:
    number = body["messages"][-1]["content"].split("\n\n")[0].removeprefix("p")
    answer = number if body["seed"] % 4 else "99"  # one sample in four is wrong
    return separated("reasoning_content", ["Think", " it", " over."], [f"$\\boxed{{{answer}}}$"])


@pytest.mark.timeout(300)
@pytest.mark.daemon
def test_eval_records_each_sample_and_the_replay_tool_reads_them(tmp_path: Path):
    problems = tmp_path / "set.jsonl"
    problems.write_text(
        "".join(json.dumps({"problem": f"p{i}", "answer": str(i)}) + "\n" for i in range(5))
    )
    results = tmp_path / "out.jsonl"
    with scripted_server(_script) as server:
        done = run_phi4(
            "eval",
            str(problems),
            "--backend",
            server.url,
            "-m",
            "m",
            "-k",
            "4",
            "--all",
            "--seed",
            "100",
            "-o",
            str(results),
            timeout=200,
        )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in results.read_text().splitlines()]
    for record in records:
        details = record["sample_details"]
        assert [d["answer"] for d in details] == ["99", *[record["reference"]] * 3]
        assert all(d["completion_tokens"] == 4 and d["reasoning_tokens"] == 3 for d in details)
        assert all(d["ended_s"] >= d["seconds"] >= 0 and not d["cancelled"] for d in details)
        assert {d["loop"] for d in details} == {None} and {d["error"] for d in details} == {False}
    replayed = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "votes.py"),
            "replay",
            str(results),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "Replayed" in replayed.stdout and "5 problems, K = 4" in replayed.stdout
    written = json.loads((tmp_path / "votes-replay-out.json").read_text())
    assert written["problems"] == 5 and written["accuracy_full"] == 1.0
    assert written["sample_accuracy"] == 0.75 and written["tie_rate"] == 0.0
    assert 0.0 <= written["tokens_saved"] < 1.0 and written["agreement_untied"] is not None


@pytest.mark.timeout(600)
@pytest.mark.daemon
def test_eval_through_the_daemon_marks_samples_a_settled_vote_cancelled_and_keeps_confidence(
    tmp_path: Path,
):
    # Before: a sample cancelled by a settled vote was also marked "error": true, and every
    # sample's confidence was null (eval never asked the daemon for it; solve --json does).
    from tests.tinymodel import write_text_script_model

    thinking = " ".join(f"w{i}" for i in range(400)) + "."  # long: the cancel comes in time
    model = write_text_script_model(tmp_path / "seven.gguf", thinking, " So $\\boxed{7}$.")
    # A context that holds one such request at a time: the samples run one after another, so
    # those after the third are still waiting in the daemon when the vote settles.
    started = run_phi4("daemon", "start", "-m", str(model), "--n-ctx", "1200")
    assert started.returncode == 0, started.stderr
    problems = tmp_path / "set.jsonl"
    problems.write_text(json.dumps({"problem": "3 plus 4?", "answer": "7"}) + "\n")
    results = tmp_path / "out.jsonl"
    done = run_phi4(
        "eval",
        str(problems),
        "-m",
        str(model),
        "-k",
        "8",
        "-t",
        "0",
        "-n",
        "900",
        "--loop",
        "off",
        "-o",
        str(results),
        timeout=500,
    )
    assert done.returncode == 0, done.stderr
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    details = record["sample_details"]
    cancelled = [d for d in details if d["cancelled"]]
    voted = [d for d in details if not d["cancelled"]]
    assert record["samples_used"] == len(voted) < 8 and len(cancelled) >= 4, details
    assert all(not d["error"] and d["answer"] is None for d in cancelled), cancelled
    assert all(not d["error"] and d["answer"] == "7" for d in voted), voted
    confidences = [d["confidence"] for d in voted]
    assert all(isinstance(c, float) and c > 0 for c in confidences), confidences
    assert record["confidence"] == [d["confidence"] for d in details if not d["cancelled"]]
