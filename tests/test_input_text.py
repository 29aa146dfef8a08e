"""Input that is not valid UTF-8 text — in an argument, an option, stdin, a file of problems, a
piped or typed chat line, a saved chat — through the real CLI: refused before any daemon starts,
in one line that says where, or (chat lines) read with replacement and said."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pexpect
import pytest

from phi4cli.client.chats import ChatStore
from phi4cli.core.paths import get_paths
from tests.conftest import PHI4, run_phi4
from tests.test_hardening import one_error_line


def run_bytes(*args: str | bytes, input: bytes | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``phi4`` with arguments or stdin that need not be UTF-8."""
    result = subprocess.run(
        [PHI4, *args],
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
    )
    return subprocess.CompletedProcess(
        result.args,
        result.returncode,
        result.stdout.decode("utf-8", "replace"),
        result.stderr.decode("utf-8", "replace"),
    )


def assert_refused_before_any_daemon(result: subprocess.CompletedProcess[str], phrase: str) -> None:
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert phrase in line, line
    assert not get_paths().socket.exists()  # no daemon was started for it


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        ((b"What is \xff?",), "the question (argument) is not valid UTF-8 (byte 0xff)"),
        (
            (b"-s", b"Be terse \xe9", "What is 2+2?"),
            "the system prompt (-s/--system or PHI4_SYSTEM) is not valid UTF-8 (byte 0xe9)",
        ),
    ],
    ids=["question", "system"],
)
@pytest.mark.daemon
def test_an_argument_that_is_not_utf8_is_refused(
    tiny_model: Path, args: tuple[bytes, ...], phrase: str
):
    # Before: "internal error: UnicodeEncodeError" after a daemon was started.
    assert_refused_before_any_daemon(run_bytes("solve", "-m", str(tiny_model), *args), phrase)


@pytest.mark.daemon
def test_stdin_that_is_not_utf8_is_refused_naming_the_line(tiny_model: Path):
    result = run_bytes("solve", "-m", str(tiny_model), "-", input=b"What is\n2+2 \xff?\n")
    assert_refused_before_any_daemon(result, "stdin line 2 is not valid UTF-8 (byte 0xff)")
    # (A pipe of problems, --each-line or --file -, is answered as it is read: a bad line
    # there is that problem's error; see test_problem_feed.)


@pytest.mark.daemon
def test_a_file_of_problems_that_is_not_utf8_is_refused_naming_the_line(
    tiny_model: Path, tmp_path: Path
):
    problems = tmp_path / "quiz.txt"
    problems.write_bytes(b"What is 1+1?\nWhat is 2+2?\nWhat is \xa33?\n")
    result = run_bytes("solve", "-m", str(tiny_model), "-f", str(problems))
    assert_refused_before_any_daemon(result, f"{problems} line 3 is not valid UTF-8 (byte 0xa3)")


@pytest.mark.daemon
def test_chat_with_a_system_prompt_that_is_not_utf8_is_refused(tiny_model: Path):
    result = run_bytes("chat", "-m", str(tiny_model), "-s", b"\xff", input=b"hi\n")
    assert_refused_before_any_daemon(result, "the system prompt (-s/--system or PHI4_SYSTEM)")


@pytest.mark.daemon
def test_a_piped_chat_line_that_is_not_utf8_is_read_with_replacement(tiny_model: Path):
    # Before: the whole chat ended with "internal error" at the bad line.
    result = run_bytes(
        "chat", "-m", str(tiny_model), "-n", "3", input=b"hello\ncaf\xe9 au lait\n/save piped\n"
    )
    assert result.returncode == 0, result.stderr
    assert "stdin line 2 is not valid UTF-8" in result.stderr
    assert "internal error" not in result.stderr
    saved = ChatStore(get_paths().data_dir / "chats").load("piped")
    assert [t.question for t in saved.turns] == ["hello", "caf\ufffd au lait"]


@pytest.mark.daemon
def test_a_typed_chat_line_that_is_not_utf8_is_read_with_replacement(tiny_model: Path):
    child = pexpect.spawn(
        PHI4,
        ["chat", "-m", str(tiny_model), "-n", "3", "--verbose"],
        encoding="utf-8",
        codec_errors="replace",
        dimensions=(24, 100),
        timeout=120,
    )
    child.logfile_read = io.StringIO()
    child.expect_exact("phi4>")
    os.write(child.child_fd, b"caf\xe9?\r")  # a Latin-1 terminal's bytes
    child.expect_exact("is not valid UTF-8")
    child.expect_exact("prompt tokens")  # --verbose: answered
    child.expect_exact("phi4>")
    child.sendline("/save typed")
    child.expect_exact("saved as typed")
    child.expect_exact("phi4>")
    child.sendcontrol("d")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.logfile_read.getvalue()
    saved = ChatStore(get_paths().data_dir / "chats").load("typed")
    assert [t.question for t in saved.turns] == ["caf\ufffd?"]


def _saved_chat(**changes: object) -> dict[str, object]:
    chat: dict[str, object] = {
        "format": 1,
        "name": "saved",
        "model": "m",
        "system": None,
        "settings": {},
        "turns": [{"question": "What is 2+2?", "answer": "4"}],
        "dropped": 0,
    }
    chat.update(changes)
    return chat


@pytest.mark.parametrize(
    ("changes", "phrase"),
    [
        (
            {"turns": [{"question": "a\ud800", "answer": ""}]},
            "turn 1: 'question' is not valid text (a lone surrogate)",
        ),
        ({"system": "\udcff"}, "'system' is not valid text"),
        (
            {"settings": {"temperature": "hot"}},
            "setting temperature: invalid temperature 'hot': expected a number from 0 to 5",
        ),
        ({"settings": {"max_tokens": -3}}, "setting max_tokens: invalid max_tokens -3"),
        ({"settings": {"colour": 3}}, "unknown setting 'colour'"),
        ({"dropped": 7}, "'dropped' is 7, not from 0 to the 1 turns"),
        ({"name": "../../etc"}, "'name' '../../etc' is not a conversation name"),
        ({"session": ""}, "'session' must be 1 to 200 characters"),
    ],
    ids=[
        "surrogate-in-a-turn",
        "surrogate-in-system",
        "temperature-hot",
        "max-tokens-negative",
        "unknown-setting",
        "dropped-too-many",
        "bad-name",
        "empty-session",
    ],
)
@pytest.mark.daemon
def test_a_saved_chat_is_checked_field_by_field(changes: dict[str, object], phrase: str):
    # Before: a surrogate ended the chat with "internal error"; bad settings were sent as is.
    chats = get_paths().data_dir / "chats"
    chats.mkdir(parents=True)
    (chats / "saved.json").write_text(json.dumps(_saved_chat(**changes)), encoding="utf-8")
    result = run_phi4("chat", "--resume", "saved", input="What next?\n")
    assert result.returncode == 1
    line = one_error_line(result.stderr)
    assert str(chats / "saved.json") in line and phrase in line, line
    assert "delete it" in line
    assert not get_paths().socket.exists()


def test_a_saved_chat_with_good_settings_loads_them_parsed():
    chats = get_paths().data_dir / "chats"
    chats.mkdir(parents=True)
    good = _saved_chat(settings={"max_tokens": "12", "seed": None, "temperature": 0})
    (chats / "saved.json").write_text(json.dumps(good), encoding="utf-8")
    assert ChatStore(chats).load("saved").settings == {
        "max_tokens": 12,
        "seed": None,
        "temperature": 0.0,
    }
