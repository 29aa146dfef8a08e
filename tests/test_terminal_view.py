"""What a person sees at a terminal: the solution's lines as the model wrote them (Markdown joins
the lines of a paragraph; a pipe never did), with lists, tables, code and math still rendered;
and an answer cut off mid-way (the daemon stopped or killed, a server that hung up) left on the
screen, with one line below it saying so, as after Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pexpect
import pytest
from rich.console import Console
from rich.markdown import Markdown
from rich.text import Text

from phi4cli.backends.outcome import Outcome
from phi4cli.client.environment import Environment
from phi4cli.client.exits import report
from phi4cli.client.presenters import TerminalPresenter, _markdown, markdown_source
from phi4cli.client.solve_job import OutputMode, SolveJob
from phi4cli.client.solving import solve_one
from phi4cli.core._settings import Ask
from phi4cli.core.errors import DaemonFrozenError, ErrorCode, ExitStatus
from phi4cli.core.protocol import Event, EventKind, SolveParams
from tests.conftest import PHI4, run_phi4
from tests.pty_screen import in_pty, plain
from tests.scripted_server import Step, chunk, data, scripted_server

LINES = "The numbers:\n1\n2\n3\nStep one: x = 2\nStep two: y = 3\nSo $\\boxed{5}$."


def rendered(solution: str, width: int = 80) -> list[str]:
    """The solution's lines as the terminal shows them (styles taken out, right ends trimmed)."""
    console = Console(file=io.StringIO(), force_terminal=True, width=width, highlight=False)
    console.print(_markdown(solution))
    shown = Text.from_ansi(console.file.getvalue()).plain  # type: ignore[attr-defined]
    return [line.rstrip() for line in shown.split("\n")]


def joined(solution: str, width: int = 80) -> list[str]:
    """The same, as plain Markdown renders it (every line of a paragraph joined)."""
    console = Console(file=io.StringIO(), force_terminal=True, width=width, highlight=False)
    console.print(Markdown(markdown_source(solution), hyperlinks=False))
    return Text.from_ansi(console.file.getvalue()).plain.split()  # type: ignore[attr-defined]


# --- the model's lines ------------------------------------------------------------------------


def test_each_line_the_model_wrote_is_a_line_on_the_terminal():
    # Before: "The numbers: 1 2 3 Step one: x = 2 Step two: y = 3 So 5." on one line.
    shown = rendered(LINES)
    assert shown[:7] == [
        "The numbers:",
        "1",
        "2",
        "3",
        "Step one: x = 2",
        "Step two: y = 3",
        "So 5.",
    ]
    # What Markdown makes of the source is the same; only the soft breaks are made hard.
    assert markdown_source(LINES) == LINES.replace("$\\boxed{5}$", "5")


SHAPES = {
    "list": "Steps:\n- add 2\n- then 3\n\n1. one\n2. two",
    "lazy continuation": "- a long item\n  goes on here\n- and the next",
    "table": "The values:\n\n| x | y |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |",
    "table after a line": "Here:\n| x | y |\n|---|---|\n| 1 | 2 |",
    "code": "Run:\n\n```python\nx = 1\ny = 2\n```\nthen\nread it",
    "indented code": "Run:\n\n    x = 1\n    y = 2\n\nDone.",
    "math": "So\n$$\nx^2 + y^2 = z^2\n$$\nand \\(\\frac{1}{2}\\) of it",
    "headings": "# Title\nfirst line\nsecond line\n\nResult\n===\nThe end\n---\nmore",
    "quote": "> quoted\n> twice\nlazily",
    "emphasis across lines": "**bold\nstill** and *it\nstays*",
    "code span across lines": "a `code\nspan` here",
}


@pytest.mark.parametrize("solution", SHAPES.values(), ids=SHAPES.keys())
def test_lists_tables_code_headings_and_math_render_as_before_but_for_line_ends(solution: str):
    # The words, in order, are those Markdown always showed: each soft break became a hard one
    # and nothing else moved (a table, a fence, a setext heading are read as before). A quote's
    # bar starts each of its lines.
    words = [word for word in " ".join(rendered(solution)).split() if word != "▌"]
    assert words == [word for word in joined(solution) if word != "▌"]


def test_each_shape_keeps_its_lines_and_its_rendering():
    def shown(name: str) -> list[str]:
        return [line.strip() for line in rendered(SHAPES[name]) if line.strip()]

    assert shown("list") == ["Steps:", "• add 2", "• then 3", "1 one", "2 two"]
    assert rendered(SHAPES["lazy continuation"])[1:4] == [
        " • a long item",
        "   goes on here",
        " • and the next",
    ]
    for table in ("table", "table after a line"):  # a table, not its source
        assert shown(table)[1:4] == ["x  y", "────", "1  2"], shown(table)
    assert shown("code") == ["Run:", "x = 1", "y = 2", "then", "read it"]
    assert shown("indented code") == ["Run:", "x = 1", "y = 2", "Done."]
    assert shown("math") == ["So", "x² + y² = z²", "and 1/2 of it"]
    # A setext heading is still one (its underline gone), its paragraph's lines kept.
    assert shown("headings") == ["Title", "first line", "second line", "Result", "The end", "more"]
    assert shown("quote") == ["▌ quoted", "▌ twice", "▌ lazily"]
    assert shown("emphasis across lines") == ["bold", "still and it", "stays"]
    assert shown("code span across lines") == ["a code span here"]  # (a code span has no lines)


def test_the_presenter_keeps_the_lines_when_done_and_when_cut_short():
    # Chat shows a reply through the same presenter (finish, or show_partial for talk with no
    # answer and for a reply cut short): its lines are kept too.
    for show in ("finish", "show_partial"):
        presenter = TerminalPresenter(show_reasoning=False, verbose=False)
        out = io.StringIO()
        presenter.out = Console(file=out, force_terminal=True, width=100, highlight=False)
        presenter.err = Console(file=io.StringIO(), force_terminal=True, width=100)
        outcome = Outcome(index=0, question="q")
        event = Event(EventKind.TOKEN, text=LINES)
        outcome.apply(event)
        presenter.on_event(event)
        getattr(presenter, show)(outcome)
        lines = [line.rstrip() for line in Text.from_ansi(out.getvalue()).plain.split("\n")]
        assert "Step one: x = 2" in lines and "1" in lines, (show, lines)


# --- an answer cut short, in-process -------------------------------------------------------------


class _Backend:
    """Streams ``events`` for the one request, then raises ``raises`` (if any)."""

    def __init__(self, events: list[Event], raises: Exception | None = None) -> None:
        self.events, self.raises = events, raises

    def run(self, requests: Any, on_event: Any, **_: Any) -> None:
        for event in self.events:
            on_event(0, event)
        if self.raises is not None:
            raise self.raises


STREAMED = [Event(EventKind.TOKEN, text=f"Line {i} of the answer.\n") for i in range(1, 6)]


def _solve(backend: _Backend, terminal: bool) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    env = Environment(
        io.StringIO(), out, err, stdout_isatty=terminal, stderr_isatty=terminal, colour=False
    )
    job = SolveJob(backend, env, SolveParams("", Ask(temperature=0.0), model="m"))  # type: ignore[arg-type]
    status = report(lambda: solve_one(job, "Count.", OutputMode()), out, err)
    return status, out.getvalue(), err.getvalue()


GONE = "the daemon went away mid-answer: the daemon closed the connection unexpectedly"
CASES = {  # the error event that ends the answer, or the error raised; the exit status
    "stopped": (
        Event.error(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"),
        None,
        ExitStatus.DAEMON_UNAVAILABLE,
    ),
    "killed": (Event.error(ErrorCode.SHUTTING_DOWN, GONE), None, ExitStatus.DAEMON_UNAVAILABLE),
    "hung up": (
        Event.error(ErrorCode.BACKEND_ERROR, "the connection to the backend broke"),
        None,
        ExitStatus.ENGINE_FAILURE,
    ),
    "frozen": (None, "the daemon sent nothing for 90 s", ExitStatus.DAEMON_UNAVAILABLE),
}


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_an_answer_cut_short_stays_with_one_line_saying_so(
    case: tuple[Event | None, str | None, int], terminal: bool, monkeypatch: pytest.MonkeyPatch
):
    # Before: at a terminal the live region was erased and only the error line was left.
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich draws its live region into the StringIO
    error, frozen, expected = case
    raises = DaemonFrozenError(frozen) if frozen else None
    status, out, err = _solve(_Backend([*STREAMED, *([error] if error else [])], raises), terminal)
    assert status == expected, err
    if terminal:
        assert "\x1b[2K" in out, "the live region was shown, then taken down"
        out = out[out.rindex("\x1b[2K") :]  # what is left on the screen
    lines = [line.rstrip() for line in plain(Text.from_ansi(out).plain).split("\n")]
    assert [line for line in lines if line.startswith("Line")] == [
        f"Line {i} of the answer." for i in range(1, 6)
    ], out
    assert out.endswith("\n")
    said = err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("phi4: error: "), err
    # One line saying it was cut, whatever the error's words (the client read none of them).
    assert said[0].endswith("; the answer above is unfinished") and said[0].count("unfinished") == 1


def test_an_error_before_any_text_says_only_the_error():
    error = Event.error(ErrorCode.SHUTTING_DOWN, GONE)
    for terminal in (True, False):
        status, out, err = _solve(_Backend([error]), terminal)
        assert status == ExitStatus.DAEMON_UNAVAILABLE
        assert out == "" and err == f"phi4: error: {GONE}\n"


# --- at a real terminal -------------------------------------------------------------------------


def _on_screen(transcript: str) -> list[str]:
    """What is left on the screen at the end: the text after the live region was last erased,
    its lines plain and trimmed."""
    kept = transcript[transcript.rindex("\x1b[2K") :] if "\x1b[2K" in transcript else transcript
    return [line.rstrip() for line in plain(kept).split("\n")]


def _line_by_line(_body: dict[str, Any]) -> list[str | Step]:
    pieces = re.split(r"(?<=\n)", LINES)
    return [*(chunk({"content": piece}) for piece in pieces), chunk({}, "stop"), data("[DONE]")]


@pytest.mark.daemon
def test_solve_and_chat_at_a_terminal_show_the_lines_as_written():
    with scripted_server(_line_by_line) as server:
        screen = _on_screen(in_pty(PHI4, ["solve", "Count", "--backend", server.url, "-m", "m"]))
        at = screen.index("The numbers:")
        assert screen[at : at + 7] == [
            "The numbers:",
            "1",
            "2",
            "3",
            "Step one: x = 2",
            "Step two: y = 3",
            "So 5.",
        ], screen
        assert any(line.startswith("Answer: 5") for line in screen[at + 7 :]), screen

        child = pexpect.spawn(
            PHI4,
            ["chat", "--backend", server.url, "-m", "m"],
            encoding="utf-8",
            dimensions=(40, 100),
            timeout=90,
        )
        child.logfile_read = transcript = io.StringIO()
        child.expect_exact("Ctrl-D to leave")
        child.sendline("Count")
        child.expect_exact("Answer:")
        reply = transcript.getvalue()
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        child.close()
    shown = _on_screen(reply)
    at = shown.index("The numbers:")
    assert shown[at : at + 6] == [
        "The numbers:",
        "1",
        "2",
        "3",
        "Step one: x = 2",
        "Step two: y = 3",
    ], shown


def _fourteen_lines_then_hang_up(_body: dict[str, Any]) -> list[str | Step]:
    lines: list[str | Step] = []
    for i in range(1, 15):  # (a pause before each: the live view is redrawn for each line)
        lines += [Step(sleep=0.05), chunk({"content": f"Line {i} of the answer.\n"})]
    return [*lines, Step(sleep=0.3), Step(drop=True)]


@pytest.mark.daemon
def test_a_server_that_hangs_up_mid_answer_leaves_what_streamed():
    with scripted_server(_fourteen_lines_then_hang_up) as server:
        child = pexpect.spawn(
            PHI4,
            ["solve", "Count", "--backend", server.url, "-m", "m"],
            encoding="utf-8",
            dimensions=(40, 100),
            timeout=60,
        )
        child.logfile_read = transcript = io.StringIO()
        child.expect(pexpect.EOF)
        child.close()
    screen = _on_screen(transcript.getvalue())
    assert child.exitstatus == ExitStatus.ENGINE_FAILURE, screen
    shown = [line for line in screen if line.startswith("Line")]
    assert shown == [f"Line {i} of the answer." for i in range(1, 15)], screen
    error = [line for line in screen if line.startswith("phi4: error:")]
    assert len(error) == 1 and error[0].endswith("; the answer above is unfinished"), screen
    assert screen.index(error[0]) > screen.index("Line 14 of the answer."), "said below it"


@pytest.mark.daemon
def test_a_chat_reply_cut_short_stays_and_the_chat_goes_on():
    with scripted_server(_fourteen_lines_then_hang_up) as server:
        child = pexpect.spawn(
            PHI4,
            ["chat", "--backend", server.url, "-m", "m"],
            encoding="utf-8",
            dimensions=(40, 100),
            timeout=90,
        )
        child.logfile_read = transcript = io.StringIO()
        child.expect_exact("Ctrl-D to leave")
        child.sendline("Count")
        child.expect_exact("the answer above is unfinished")
        said = transcript.getvalue()
        child.expect_exact("phi4>")  # the chat goes on
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        child.close()
    assert child.exitstatus == 1, "a message got no answer"
    error = said.rindex("phi4: error:")
    screen = _on_screen(said[:error]) + plain(said[error:]).rstrip().split("\n")
    shown = [line for line in screen if line.startswith("Line")]
    assert shown == [f"Line {i} of the answer." for i in range(1, 15)], screen
    # (What follows the line on the screen — the prompt's own cursor moves — is not the test's.)
    errors = [line.strip() for line in screen if line.startswith("phi4: error:")]
    assert errors == [
        "phi4: error: the backend closed the stream before the answer was "
        "complete; the answer above is unfinished"
    ], screen
    below = next(i for i, line in enumerate(screen) if line.startswith("phi4: error:"))
    assert below > screen.index("Line 14 of the answer."), "said below it"


@pytest.fixture
def streaming(tiny_model: Path) -> Iterator[pexpect.spawn]:
    """``phi4 solve`` at a terminal, streaming a long answer of the tiny model from a warm
    daemon, once the live region shows some of it."""
    assert run_phi4("warm", "-m", str(tiny_model)).returncode == 0
    child = pexpect.spawn(
        PHI4,
        ["solve", "Count.", "-m", str(tiny_model), "-n", "6000", "-t", "1", "--seed", "3"],
        encoding="utf-8",
        dimensions=(40, 100),
        timeout=60,
    )
    child.logfile_read = io.StringIO()
    child.expect_exact("\x1b[2K")  # the live region, redrawn
    child.expect(r"\w{3}")  # and text in it
    time.sleep(0.5)
    yield child
    child.close(force=True)


def _daemon_pid() -> int:
    result = run_phi4("status", "--json")
    assert result.returncode == 0, result.stderr
    return int(json.loads(result.stdout)["pid"])


def _last_frame(transcript: str) -> str:
    """The live region as it was last drawn: the text between the last two erases."""
    frames = [
        frame
        for frame in re.split(r"\r?(?:\x1b\[2K|\x1b\[1A)+", transcript)
        if plain(frame).strip()
    ]
    return frames[-2]


@pytest.mark.daemon
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["phi4 stop", "SIGKILL"])
def test_a_daemon_stopped_or_killed_mid_answer_leaves_what_streamed(
    streaming: pexpect.spawn, how: str
):
    # Before: the live region was taken down and the answer never shown again: only the error
    # line was left on the screen.
    if how == "phi4 stop":
        assert run_phi4("stop").returncode == 0
    else:
        os.kill(_daemon_pid(), signal.SIGKILL)
    streaming.expect(pexpect.EOF)
    streaming.close()
    transcript = streaming.logfile_read.getvalue()  # type: ignore[union-attr]
    assert streaming.exitstatus == ExitStatus.DAEMON_UNAVAILABLE, transcript[-2000:]
    screen = _on_screen(transcript)
    error = [line for line in screen if line.startswith("phi4: error:")]
    assert len(error) == 1, screen
    if how == "phi4 stop":
        assert error[0] == (
            "phi4: error: the daemon is shutting down; the answer above is unfinished"
        )
    else:
        assert error[0].startswith("phi4: error: the daemon went away mid-answer")
        assert error[0].endswith("; the answer above is unfinished"), error
    answer = " ".join(screen[: screen.index(error[0])])
    assert len(answer.split()) > 20, screen  # the answer so far, above the error line
    # Among it, the words the live region showed last.
    words = re.findall(r"[A-Za-z]{4,}", plain(_last_frame(transcript)))
    assert words
    flat = "".join(answer.split())
    assert sum(word in flat for word in words) >= 0.9 * len(words), (words, answer)
