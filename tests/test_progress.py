"""The progress bar of `--file` and `eval`: n/N and the time from the start, the rate and time
left once one is done, and notices and results printed above the bar, never onto its line."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pexpect
import pytest

from phi4cli.client.environment import Environment
from phi4cli.client.progress import FileProgress
from phi4cli.core.protocol import Event, EventKind
from tests.conftest import PHI4, run_phi4

# Cursor movement, erase and colour sequences: what a terminal acts on, not what it shows.
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def screen_lines(raw: str) -> list[str]:
    """What a terminal shows line by line, each rewrite of a line on its own (\\r, \\n)."""
    return [part.strip() for part in re.split(r"[\r\n]", _CONTROL.sub("", raw)) if part.strip()]


def terminal_env(stdout_isatty: bool = True) -> tuple[Environment, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    env = Environment(
        io.StringIO(), out, err, stdout_isatty=stdout_isatty, stderr_isatty=True, colour=True
    )
    return env, out, err


def token(text: str = "x") -> Event:
    return Event(EventKind.TOKEN, text=text)


def test_the_bar_shows_n_of_n_and_time_before_the_first_result():
    env, _out, err = terminal_env()
    with FileProgress(3, env) as progress:
        first = screen_lines(err.getvalue())
        assert any("0/3" in line and "0:00:0" in line for line in first), first
        progress.see(0, token())
        progress.see(1, token())
        progress._progress.refresh()
        assert any("0/3" in line and "2 running" in line for line in screen_lines(err.getvalue()))
        progress.advance(0)
        progress._progress.refresh()
        shown = [line for line in screen_lines(err.getvalue()) if "1/3" in line]
        # Once one is done: the rate and the time left.
        assert shown and "1 running" in shown[-1] and "left" in shown[-1], shown


def test_with_a_token_budget_the_bar_moves_as_the_model_writes():
    env, _out, err = terminal_env()
    with FileProgress(2, env, budget=10) as progress:
        task = progress._progress.tasks[0]
        for _piece in range(5):
            progress.see(0, token())
        assert task.completed == 0.5
        for _piece in range(50):  # past its budget: never counted as done before it is
            progress.see(1, token())
        assert task.completed == 0.5 + 0.95
        progress._progress.refresh()
        assert "0/2" in screen_lines(err.getvalue())[-1]
        progress.advance(1)
        assert task.completed == 1.5


def test_a_loading_model_is_said_on_the_bar_until_the_model_writes():
    env, _out, err = terminal_env()
    with FileProgress(2, env) as progress:
        progress.see(0, Event(EventKind.ACCEPTED, data={"ahead": 0, "state": "loading"}))
        progress._progress.refresh()
        assert any("loading the model" in line for line in screen_lines(err.getvalue()))
        progress.see(0, token())
        progress._progress.refresh()
        assert "1 running" in screen_lines(err.getvalue())[-1]


def test_notices_and_results_land_on_lines_of_their_own_above_the_bar():
    env, out, err = terminal_env()
    notice = "waiting for memory: a request reserves 4,096 tokens of context"
    with FileProgress(3, env) as progress:
        progress.notice(notice)
        progress.out("[1] What is 2+2?")
    lines = screen_lines(err.getvalue())
    assert f"phi4: {notice}" in lines, lines
    assert "[1] What is 2+2?" in lines, lines
    assert out.getvalue() == ""  # stdout is the same terminal: printed above the bar


def test_without_a_terminal_there_is_no_bar_and_output_goes_where_it_always_did():
    out, err = io.StringIO(), io.StringIO()
    env = Environment(io.StringIO(), out, err, stdout_isatty=False, stderr_isatty=False)
    with FileProgress(3, env) as progress:
        progress.see(0, token())
        progress.notice("loading tiny.gguf...")
        progress.out("4")
        progress.advance(0)
    assert out.getvalue() == "4\n"
    assert err.getvalue() == "phi4: loading tiny.gguf...\n"


def test_a_redirected_stdout_keeps_its_results_while_the_bar_is_on_the_terminal():
    env, out, err = terminal_env(stdout_isatty=False)
    with FileProgress(1, env) as progress:
        progress.out('{"line": 1}')
    assert out.getvalue() == '{"line": 1}\n'
    assert '{"line": 1}' not in err.getvalue()


@pytest.mark.daemon
def test_file_progress_through_a_terminal(tiny_model: Path, tmp_path: Path):
    problems = tmp_path / "problems.txt"
    problems.write_text("What is 1+1?\nWhat is 2+2?\nWhat is 3+3?\n")
    child = pexpect.spawn(
        PHI4,
        ["solve", "--file", str(problems), "-m", str(tiny_model), "-n", "3", "-t", "0"],
        encoding="utf-8",
        dimensions=(24, 120),
        timeout=120,
    )
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    lines = screen_lines(child.before)
    assert any("solving" in line and "0/3" in line for line in lines), lines
    # The cold start's notice has a line of its own, not the bar's.
    assert "phi4: starting the phi4 daemon (first call; later calls reuse it)..." in lines, lines
    assert all(not (line.startswith("phi4:") and "/3" in line) for line in lines), lines
    assert "[3] What is 3+3?" in lines


@pytest.mark.daemon
def test_a_model_load_is_one_live_line_with_seconds_at_a_terminal_and_a_notice_in_a_pipe(
    tiny_model: Path, tiny_reasoning_model: Path
):
    # A daemon holding another model must load this one: it says so (a `progress` event)
    # before it starts loading, however fast the machine.
    assert run_phi4("daemon", "start", "-m", str(tiny_model)).returncode == 0
    child = pexpect.spawn(
        PHI4,
        ["solve", "What is 2+2?", "-m", str(tiny_reasoning_model), "-n", "3", "-t", "0"],
        encoding="utf-8",
        dimensions=(24, 120),
        timeout=120,
    )
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus in (0, 1), child.before  # 1: -n 3 ends the thinking unfinished
    lines = screen_lines(child.before)
    # What the daemon is doing (as fast as this machine goes: loading, warming up or loaded)
    # and the seconds so far, rewritten in place.
    model = r"tiny-reasoning\.gguf"
    states = rf"(loading {model}|warming up {model}|{model} is loaded, reading the question)"
    live = [line for line in lines if re.search(states + r"… \d+ s$", line)]
    assert live, lines
    assert not any(
        line.startswith("phi4: loading") or "waiting for the daemon" in line for line in lines
    ), lines
    # In a pipe: the one notice, no live line.
    piped = run_phi4("solve", "What is 2+2?", "-m", str(tiny_model), "-n", "3", "-t", "0")
    assert piped.returncode == 0, piped.stderr
    assert f"phi4: loading {tiny_model}...\n" in piped.stderr
    assert "…" not in piped.stderr and "\x1b" not in piped.stderr


@pytest.mark.daemon
def test_eval_progress_through_a_terminal(tiny_model: Path, tmp_path: Path):
    problems = tmp_path / "quiz.jsonl"
    problems.write_text(
        '{"problem": "What is 1+1?", "answer": "2"}\n{"problem": "What is 2+2?", "answer": "4"}\n'
    )
    child = pexpect.spawn(
        PHI4,
        ["eval", str(problems), "-m", str(tiny_model), "-n", "3", "-t", "0"],
        encoding="utf-8",
        dimensions=(24, 120),
        timeout=120,
    )
    child.expect(pexpect.EOF)
    child.close()
    lines = screen_lines(child.before)
    assert any("0/2" in line and "0:00:0" in line for line in lines), lines
    assert "phi4: starting the phi4 daemon (first call; later calls reuse it)..." in lines, lines
    assert all(not (line.startswith("phi4:") and "/2" in line) for line in lines), lines


def test_a_notice_during_the_load_line_or_the_spinner_has_a_line_of_its_own():
    from phi4cli.client.progress import LoadLine, StderrStatus

    env, _out, err = terminal_env()
    line = LoadLine(env)
    line.start("/models/tiny.gguf")
    env.notice("waiting for memory: a request reserves 4,096 tokens of context")
    line.stop()
    spinner = StderrStatus(env, "solving…")
    spinner.see(token())
    env.notice("line 2: no final answer")
    spinner.stop()
    env.notice("after: plain")
    lines = screen_lines(err.getvalue())
    assert any(re.search(r"loading tiny\.gguf… \d+ s$", text) for text in lines), lines
    for notice in (
        "phi4: waiting for memory: a request reserves 4,096 tokens of context",
        "phi4: line 2: no final answer",
        "phi4: after: plain",
    ):
        assert notice in lines, lines
    assert env.print_above_live is None
