"""Answer now at a terminal (issue 49): in ``phi4 solve`` and in ``phi4 chat``, Enter while the
model thinks — the live line offers it — closes the thinking, the model answers from what it
has, and the line left behind says it was answered early; Ctrl-C keeps its meaning, and the
terminal is given back as it was. (The wire and both engines: tests/test_answer_now.py.)"""

from __future__ import annotations

import io
import re
import shlex
from pathlib import Path

import pexpect
import pytest

from phi4cli.backends.outcome import Outcome
from phi4cli.client.keys import ANSWER_NOW_HINT, AnswerNow
from phi4cli.core.protocol import Event, EventKind, Stats
from tests.conftest import PHI4, run_phi4
from tests.pty_screen import plain
from tests.scripted_server import scripted_server
from tests.test_answer_now import ANSWER, LOOPING, START, endless_server
from tests.tinymodel import write_text_script_model

# Long enough a thinking that it is still going when the key is pressed: it never ends by
# itself (the script model loops, the loop rule is off), and runs to this many tokens.
THINKING = ["-t", "0", "-n", "8000", "--loop", "off"]


@pytest.fixture(scope="module")
def endless_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("answer-now-keys")
    return write_text_script_model(
        folder / "endless.gguf", START + LOOPING, ANSWER, loop_from=len(START)
    )


@pytest.mark.timeout(300)
@pytest.mark.daemon
def test_enter_while_solve_thinks_answers_now(endless_model: Path):
    assert run_phi4("daemon", "start", "-m", str(endless_model)).returncode == 0
    solve = shlex.join([PHI4, "solve", "What is 3+4?", "-m", str(endless_model), *THINKING])
    # The terminal's modes after phi4 is done: as before (echo, line editing).
    child = pexpect.spawn(
        "/bin/sh",
        ["-c", f"stty -a; {solve}; echo status=$?; stty -a"],
        encoding="utf-8",
        dimensions=(40, 120),
        timeout=90,
    )
    child.logfile_read = transcript = io.StringIO()
    child.expect_exact(ANSWER_NOW_HINT)
    child.send("\r")
    child.expect_exact("answered early")
    child.expect(pexpect.EOF)
    child.close()
    screen = plain(transcript.getvalue())
    assert "status=0" in screen, screen
    assert "Answer: 7" in screen, screen
    assert re.search(r"Thought for \d+\.\d s \(answered early\)", screen), screen
    before, after = (
        re.findall(r"(?<![\w-])-?(?:echo|icanon)(?![\w-])", part)
        for part in screen.split("status=0")
    )
    assert set(after) == set(before[:2]) == {"echo", "icanon"}, (before, after)


@pytest.mark.timeout(300)
@pytest.mark.daemon
def test_enter_while_solve_thinks_answers_now_through_a_remote_engine():
    with scripted_server(endless_server) as server:
        child = pexpect.spawn(
            PHI4,
            ["solve", "What is 3+4?", "--backend", server.url, "-m", "m", *THINKING],
            encoding="utf-8",
            dimensions=(40, 120),
            timeout=90,
        )
        child.logfile_read = transcript = io.StringIO()
        child.expect_exact(ANSWER_NOW_HINT)
        child.send("\r")
        child.expect(pexpect.EOF)
        child.close()
        bodies = server.bodies
    screen = plain(transcript.getvalue())
    assert child.exitstatus == 0, screen
    assert re.search(r"Thought for \d+\.\d s \(answered early\)", screen), screen
    assert "Answer: 7" in screen, screen
    assert len(bodies) == 2 and bodies[1]["messages"][-1]["content"].endswith("</think>\n\n")


@pytest.mark.timeout(300)
@pytest.mark.daemon
def test_ctrl_c_while_solve_thinks_still_stops_it(endless_model: Path):
    assert run_phi4("daemon", "start", "-m", str(endless_model)).returncode == 0
    child = pexpect.spawn(
        PHI4,
        ["solve", "What is 3+4?", "-m", str(endless_model), *THINKING],
        encoding="utf-8",
        dimensions=(40, 120),
        timeout=90,
    )
    child.logfile_read = transcript = io.StringIO()
    child.expect_exact(ANSWER_NOW_HINT)
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    screen = plain(transcript.getvalue())
    assert child.exitstatus == 130, screen
    assert "stopped (Ctrl-C) before the answer began" in screen, screen
    assert "answered early" not in screen


@pytest.mark.timeout(300)
@pytest.mark.daemon
def test_enter_while_chat_thinks_answers_now_and_the_chat_goes_on(endless_model: Path):
    child = pexpect.spawn(
        PHI4,
        ["chat", "-m", str(endless_model), *THINKING],
        encoding="utf-8",
        dimensions=(40, 120),
        timeout=90,
    )
    child.logfile_read = transcript = io.StringIO()
    child.expect_exact("phi4>")
    child.sendline("What is 3+4?")
    child.expect_exact(ANSWER_NOW_HINT)
    child.send("\r")
    child.expect_exact("answered early")
    child.expect_exact("phi4>")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    screen = plain(transcript.getvalue())
    assert child.exitstatus == 0, screen
    assert "7" in screen.split("answered early")[1], screen


# --- the key's rule, without a terminal -------------------------------------------------------


class _Keys:
    def __init__(self) -> None:
        self.typed: list[bool] = []

    def enter(self) -> bool:
        return self.typed.pop(0) if self.typed else False


def test_enter_counts_only_while_the_model_thinks_and_once():
    keys, asked, told = _Keys(), [], []
    hurry = AnswerNow(keys, lambda: asked.append(1), lambda: told.append(1))  # type: ignore[arg-type]

    def see(kind: EventKind, pressed: bool) -> None:
        keys.typed.append(pressed)
        hurry.see(Event(kind, text="x"))

    see(EventKind.ACCEPTED, True)  # before the thinking: typed ahead, discarded
    see(EventKind.REASONING, True)  # its first piece: what came before is not for it
    assert asked == []
    see(EventKind.REASONING, False)
    see(EventKind.REASONING, True)
    see(EventKind.REASONING, True)  # once
    assert asked == told == [1]
    keys2, asked2 = _Keys(), []
    late = AnswerNow(keys2, lambda: asked2.append(1), lambda: None)  # type: ignore[arg-type]
    for kind, pressed in (
        (EventKind.REASONING, False),
        (EventKind.TOKEN, True),
        (EventKind.TOKEN, True),
    ):
        keys2.typed.append(pressed)
        late.see(Event(kind, text="x"))
    assert asked2 == []  # the thinking was over


def test_the_json_record_says_answered_early_at_the_top():
    outcome = Outcome(0, "q")
    outcome.apply(Event.of_stats(Stats(answered_early=True, finish_reason="stop")))
    outcome.apply(Event(EventKind.DONE))
    record = outcome.to_json()
    assert record["answered_early"] is True and record["stats"]["answered_early"] is True
