"""Reasoning-aware output end to end: terminal vs pipe, --json/--jsonl, --file, budgets, samples."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import time
from pathlib import Path

import pexpect
import pytest

from phi4cli.backends.outcome import Outcome
from phi4cli.core.protocol import Event, EventKind
from tests.conftest import PHI4, run_phi4

ANSI = "\x1b["


@pytest.mark.daemon
def test_piped_output_is_plain_text_with_the_solution_only(tiny_model: Path):
    result = run_phi4("solve", "What is 12*13?", "-m", str(tiny_model), "-t", "0", "-n", "12")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert ANSI not in result.stdout and ANSI not in result.stderr
    assert "Answer:" not in result.stdout


@pytest.mark.daemon
def test_terminal_output_has_thinking_line_rendered_solution_and_answer_line(
    tiny_reasoning_model: Path,
):
    child = pexpect.spawn(
        PHI4,
        [
            "solve",
            "What is 12*13?",
            "-m",
            str(tiny_reasoning_model),
            "-t",
            "0",
            "-n",
            "400",
            "--think-budget",
            "300",
        ],
        encoding="utf-8",
        dimensions=(24, 100),
        timeout=60,
    )
    child.expect(pexpect.EOF)
    child.close()
    screen = child.before
    assert child.exitstatus == 0, screen
    assert "thinking…" in screen  # the live status line while the model thinks
    assert ANSI in screen
    # The tiny model never states an answer; phi4 says so rather than guessing (and that the
    # answer was cut at --max-tokens).
    assert "no final answer: the answer was cut off at --max-tokens" in screen


def test_terminal_presenter_renders_markdown_math_and_highlights_the_answer(monkeypatch):
    from rich.console import Console

    from phi4cli.client.presenters import TerminalPresenter

    presenter = TerminalPresenter(show_reasoning=False, verbose=False)
    buffer = io.StringIO()
    presenter.out = Console(
        file=buffer, force_terminal=True, width=80, color_system="standard", highlight=False
    )
    presenter.err = Console(file=io.StringIO(), force_terminal=True, width=80)
    outcome = Outcome(index=0, question="q")
    events = [
        Event(EventKind.REASONING, text="Let me compute."),
        Event(EventKind.TOKEN, text="**Step 1.** $x^2 = \\frac{1}{4}$, so "),
        Event(EventKind.TOKEN, text="$x = \\boxed{\\dfrac{1}{2}}$."),
    ]
    for event in events:
        outcome.apply(event)
        presenter.on_event(event)
    presenter.finish(outcome)
    # What stays on screen: everything after the transient live region was taken down.
    text = buffer.getvalue().split("\x1b[?25h")[-1]
    assert "x² = 1/4" in text
    assert "Step 1." in text and "**" not in text  # Markdown rendered, not shown raw
    assert "Answer:" in text and "1/2" in text.split("Answer:")[1]
    assert "\x1b[1;32mAnswer:" in text  # highlighted
    assert "Let me compute" not in text  # reasoning is folded away


@pytest.mark.daemon
def test_show_reasoning_goes_to_stderr_and_never_stdout(tiny_reasoning_model: Path):
    args = ["solve", "Q?", "-m", str(tiny_reasoning_model), "-t", "0", "-n", "20"]
    record = json.loads(run_phi4(*args, "--think-budget", "10", "--json").stdout)
    assert record["reasoning"].strip() and record["solution"].strip()
    folded = run_phi4(*args, "--think-budget", "10")
    shown = run_phi4(*args, "--think-budget", "10", "-r")
    assert folded.returncode == shown.returncode == 0
    assert folded.stdout == shown.stdout == record["solution"].rstrip("\n") + "\n"
    assert record["reasoning"].strip() not in folded.stderr
    assert record["reasoning"].strip() in shown.stderr


@pytest.mark.daemon
def test_think_budget_closes_thinking_on_the_tiny_model(tiny_reasoning_model: Path):
    result = run_phi4(
        "solve",
        "What is 12*13?",
        "-m",
        str(tiny_reasoning_model),
        "-t",
        "0",
        "-n",
        "30",
        "--think-budget",
        "8",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    stats = record["stats"]
    assert stats["budget_reached"] is True
    assert stats["reasoning_tokens"] == 8
    assert stats["answer_tokens"] == stats["completion_tokens"] - 8 > 0
    assert record["reasoning"] and record["solution"]
    assert not stats["thinking_unfinished"]


@pytest.mark.daemon
def test_unfinished_thinking_says_so_and_answers_nothing(tiny_reasoning_model: Path):
    args = ["solve", "What is 12*13?", "-m", str(tiny_reasoning_model), "-t", "0", "-n", "15"]
    as_json = run_phi4(*args, "--json")
    record = json.loads(as_json.stdout)
    assert record["thinking_unfinished"] is True and record["stats"]["thinking_unfinished"]
    assert record["solution"] == "" and record["answer"] is None
    assert as_json.returncode == 1 and "thinking did not finish" in as_json.stderr
    # Before: in a pipeline, stdout was empty, stderr said nothing and the exit status was 0.
    piped = run_phi4(*args)
    assert (piped.returncode, piped.stdout) == (1, "")
    assert "no final answer: the thinking did not finish" in piped.stderr
    answer_only = run_phi4(*args, "--answer-only")
    assert answer_only.returncode == 1
    assert answer_only.stdout == "\n"
    assert "thinking did not finish" in answer_only.stderr


@pytest.mark.daemon
def test_json_has_every_field(tiny_model: Path):
    result = run_phi4("solve", "2+2?", "-m", str(tiny_model), "-n", "4", "--seed", "7", "--json")
    record = json.loads(result.stdout)
    for key in ("question", "answer", "solution", "reasoning", "stats", "model", "seed"):
        assert key in record
    assert record["question"] == "2+2?"
    assert record["seed"] == 7
    assert record["model"] == str(tiny_model)


@pytest.mark.daemon
def test_file_answers_in_input_order_with_a_failing_line_in_the_middle(
    tiny_model: Path, tmp_path: Path
):
    problems = tmp_path / "problems.txt"
    long_line = " ".join(["twelve times thirteen"] * 100)  # far beyond a 128-token context
    problems.write_text(f"What is 1+1?\n\nWhat is 2+2?\n{long_line}\nWhat is 3+3?\n")
    result = run_phi4(
        "solve",
        "--file",
        str(problems),
        "--jsonl",
        "-m",
        str(tiny_model),
        "-n",
        "4",
        "-t",
        "0",
        "--n-ctx",
        "128",
    )
    assert result.returncode == 1, "the exit code says a problem failed"
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["line"] for r in records] == [1, 3, 4, 5]
    assert [r["question"] for r in records][:2] == ["What is 1+1?", "What is 2+2?"]
    assert records[2]["error"]["code"] == "context_overflow"
    assert all("error" not in r and r["solution"] for r in records if r["line"] != 4)
    assert "1 of 4 problems failed" in result.stderr
    # The same problems answered one by one give the same text (greedy): order is kept.
    alone = run_phi4("solve", "What is 3+3?", "-m", str(tiny_model), "-n", "4", "-t", "0")
    assert records[3]["solution"] == alone.stdout.rstrip("\n")


@pytest.mark.daemon
def test_each_line_from_stdin_with_answer_only_keeps_one_line_per_problem(tiny_model: Path):
    result = run_phi4(
        "solve",
        "-",
        "--each-line",
        "--answer-only",
        "-m",
        str(tiny_model),
        "-n",
        "3",
        input="a\nb\nc\n",
    )
    assert result.stdout.count("\n") == 3
    # No line stated an answer: as for one question, --answer-only exits 1 and says why per line.
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("no final answer: the answer was cut off at --max-tokens") == 3


@pytest.mark.daemon
def test_file_output_survives_head(tiny_model: Path, tmp_path: Path):
    problems = tmp_path / "p.txt"
    problems.write_text("\n".join(f"Problem {i}" for i in range(20)))
    pipeline = subprocess.run(
        [
            "bash",
            "-c",
            f'"{PHI4}" solve -f "{problems}" --jsonl -m "{tiny_model}" -n 50 '
            '</dev/null | head -1; echo "rc=${PIPESTATUS[0]}" >&2',
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert json.loads(pipeline.stdout)["line"] == 1
    assert "Traceback" not in pipeline.stderr
    assert "rc=0" in pipeline.stderr


@pytest.mark.daemon
def test_ctrl_c_cancels_every_problem_of_a_file(tiny_model: Path, tmp_path: Path):
    problems = tmp_path / "p.txt"
    problems.write_text("\n".join(f"Count to {i}" for i in range(10)))
    proc = subprocess.Popen(
        [
            PHI4,
            "solve",
            "-f",
            str(problems),
            "-m",
            str(tiny_model),
            "-n",
            "90000",
            "--n-ctx",
            "100000",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = run_phi4("status", "--json")
        if status.returncode == 0 and json.loads(status.stdout)["requests_active"] >= 10:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    # Said, as for one question (before: exit 130 and nothing on stderr).
    said = "phi4: stopped (Ctrl-C) after 0 of 10 problems; the rest were not answered"
    assert said in err.decode().splitlines()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = json.loads(run_phi4("status", "--json").stdout)
        if status["requests_active"] == 0 and status["queued"] == 0:
            break
        time.sleep(0.1)
    assert status["requests_active"] == 0 and status["queued"] == 0


@pytest.mark.daemon
def test_samples_vote_and_report_agreement(tiny_model: Path):
    result = run_phi4(
        "solve",
        "What is 12*13?",
        "-m",
        str(tiny_model),
        "-n",
        "6",
        "--samples",
        "3",
        "--seed",
        "1",
        "--json",
    )
    # The tiny model states no answer: the record is printed all the same, and the vote's lack
    # of an answer is a failure (tests/test_vote_exits.py).
    assert result.returncode == 1, result.stderr
    assert "no final answer: none of the 3 samples stated one" in result.stderr
    record = json.loads(result.stdout)
    assert len(record["samples"]) == 3
    assert [s["seed"] for s in record["samples"]] == [1, 2, 3]
    assert record["agreement"].endswith("/3")
    plain = run_phi4("solve", "Q", "-m", str(tiny_model), "-n", "4", "-k", "2")
    assert plain.returncode == 1
    assert "samples agree" in plain.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--jsonl", "x"], "--jsonl goes with --file"),
        (["--file", "/nonexistent/problems.txt"], "cannot read"),
        (["--samples", "2", "--file", "x"], "--samples works on one question"),
    ],
)
@pytest.mark.daemon
def test_option_misuse_is_a_usage_error(tiny_model: Path, args: list[str], phrase: str):
    result = run_phi4("solve", *args, "-m", str(tiny_model))
    assert result.returncode == 2
    assert phrase in result.stderr


@pytest.mark.daemon
def test_answer_only_output_lines_up_with_input_lines_blank_ones_included(
    tiny_model: Path, tmp_path: Path
):
    # Before: a blank line between problems shifted every later answer up one line.
    problems = tmp_path / "gaps.txt"
    problems.write_text("What is 1+1?\n\n\nWhat is 2+2?\n\nWhat is 3+3?\n\n")
    result = run_phi4(
        "solve", "-f", str(problems), "--answer-only", "-m", str(tiny_model), "-n", "2"
    )
    lines = result.stdout.split("\n")[:-1]
    assert len(lines) == len(problems.read_text().split("\n")[:-1]) == 7
    assert [n for n, text in enumerate(lines, 1) if text] == [], "the tiny model states no answer"
    warned = {
        int(w.split()[2].rstrip(":"))
        for w in result.stderr.splitlines()
        if w.startswith("phi4: line ")
    }
    assert warned == {1, 4, 6}, "each problem's line number, as in the input"
    jsonl = run_phi4("solve", "-f", str(problems), "--jsonl", "-m", str(tiny_model), "-n", "2")
    assert [json.loads(r)["line"] for r in jsonl.stdout.splitlines()] == [1, 4, 6]


@pytest.mark.daemon
def test_an_answer_cut_off_at_max_tokens_is_said_in_a_pipe_as_at_a_terminal(tiny_model: Path):
    # Before: at a terminal a yellow "cut off at --max-tokens" line, in a pipe the text simply
    # stopped, so a script could not tell a truncated answer from a whole one.
    assert run_phi4("warm", "-m", str(tiny_model)).returncode == 0
    piped = run_phi4("solve", "What is 7*8?", "-m", str(tiny_model), "-n", "3", "-t", "0")
    assert piped.returncode == 0 and piped.stdout.strip(), "the text is still the output"
    assert piped.stderr == (
        "phi4: no final answer: the answer was cut off at --max-tokens (raise it)\n"
    )
    as_json = run_phi4(
        "solve", "What is 7*8?", "-m", str(tiny_model), "-n", "3", "-t", "0", "--json"
    )
    assert as_json.returncode == 0 and as_json.stderr == ""
    assert json.loads(as_json.stdout)["stats"]["finish_reason"] == "length"
