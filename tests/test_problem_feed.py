"""`--file` input read as the run goes (phi4cli.client.problems.ProblemFeed, open_problems): line
numbers as before, a pipe's bad line as that problem's error, a file's refused before the run,
and no more than AHEAD problems read ahead of the output."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest

from phi4cli.client import problems
from phi4cli.client.environment import Environment
from phi4cli.client.problems import ProblemFeed, open_problems
from phi4cli.core.errors import UsageError
from phi4cli.core.protocol import ErrorCode, Event


def read_all(feed: ProblemFeed) -> list[tuple[int, object]]:
    deadline = time.monotonic() + 60
    while not feed.ended and time.monotonic() < deadline:
        feed.wait(0.1)
    return [(feed.numbers[i], feed[i]) for i in range(len(feed))]


def made(question: str) -> dict[str, str]:
    return {"prompt": question}


def test_lines_are_numbered_as_splitlines_numbers_them():
    data = b"one\n\n  two  \r\nthree\rfour\n\n"
    feed = ProblemFeed(io.BytesIO(data), "stdin", made)
    assert read_all(feed) == [
        (1, {"prompt": "one"}),
        (3, {"prompt": "two"}),
        (4, {"prompt": "three"}),
        (5, {"prompt": "four"}),
    ]
    assert feed.total == len(data.decode().splitlines())


def test_a_line_of_a_pipe_that_is_not_utf8_is_that_problems_error():
    feed = ProblemFeed(io.BytesIO(b"fine\nbad \xff\nfine too\n"), "stdin", made)
    read = read_all(feed)
    assert read[0] == (1, {"prompt": "fine"}) and read[2] == (3, {"prompt": "fine too"})
    line, error = read[1]
    assert line == 2 and isinstance(error, Event)
    assert error.data["code"] == ErrorCode.BAD_REQUEST
    assert error.message.startswith("stdin line 2 is not valid UTF-8 (byte 0xff): convert it")


def test_no_more_than_ahead_problems_are_read_before_they_are_printed(monkeypatch):
    monkeypatch.setattr(problems, "AHEAD", 8)
    feed = ProblemFeed(io.BytesIO(b"".join(b"q%d\n" % i for i in range(100))), "stdin", made)

    def reaches(count: int, settle: bool = True) -> None:
        deadline = time.monotonic() + 60
        while len(feed) < count and time.monotonic() < deadline:
            feed.wait(0.05)
        if settle:
            time.sleep(0.1)  # room for the reader to run past it, if it were to

    reaches(8)
    assert len(feed) == 8 and not feed.ended
    for i in range(5):
        feed.printed(i)
    reaches(13)
    assert len(feed) == 13
    for i in range(5, 100):
        reaches(i + 1, settle=False)
        assert feed[i] == {"prompt": f"q{i}"}
        feed.printed(i)
    assert feed.ended and feed.numbers == list(range(1, 101))


def test_a_file_is_checked_to_its_end_before_the_run(tmp_path: Path):
    good = tmp_path / "good.txt"
    good.write_bytes(b"a\n\nb\n")
    opened = open_problems(str(good), Environment())
    assert (opened.where, opened.known, opened.owned) == (str(good), 2, True)
    assert opened.stream.read() == b"a\n\nb\n", "read again from its start by the run"
    opened.stream.close()
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a\nb\xa3\n")
    with pytest.raises(UsageError, match=r"bad.txt line 2 is not valid UTF-8 \(byte 0xa3\)"):
        open_problems(str(bad), Environment())
    blank = tmp_path / "blank.txt"
    blank.write_bytes(b"\n  \n")
    with pytest.raises(UsageError, match="no problems"):
        open_problems(str(blank), Environment())


def test_a_pipe_is_not_read_before_the_run():
    read, write = os.pipe()
    with os.fdopen(read, "rb") as pipe, os.fdopen(write, "wb"):
        env = Environment(stdin=io.TextIOWrapper(pipe))
        opened = open_problems("-", env)
        assert (opened.where, opened.known, opened.owned) == ("stdin", None, False)


# --- through the real command -------------------------------------------------------------------


@pytest.mark.daemon
def test_a_pipes_first_problems_are_answered_before_it_ends(tiny_model: Path):
    # Before: all of stdin was read before the first problem was sent.
    import json
    import queue
    import subprocess
    import threading

    from tests.conftest import PHI4

    proc = subprocess.Popen(
        [PHI4, "solve", "-m", str(tiny_model), "-t", "0", "-n", "8", "--file", "-", "--jsonl"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()  # stdout's lines, then None at its end

    def read() -> None:
        for line in proc.stdout or ():
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        proc.stdin.write("What is 1+1?\n\nWhat is 2+2?\n")
        proc.stdin.flush()
        # The input is still open: two records come all the same (a bound on a stuck run).
        first = [lines.get(timeout=300) for _ in range(2)]
        proc.stdin.write("What is 3+3?\n")
        proc.stdin.close()
        proc.wait(timeout=300)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    rest = list(iter(lambda: lines.get(timeout=60), None))
    assert proc.returncode == 0, err
    records = [json.loads(line or "null") for line in [*first, *rest]]
    assert [(r["line"], r["question"]) for r in records] == [
        (1, "What is 1+1?"),
        (3, "What is 2+2?"),
        (4, "What is 3+3?"),
    ]


@pytest.mark.daemon
def test_a_bad_line_in_a_pipe_is_its_problems_error_and_the_rest_are_answered(tiny_model: Path):
    import subprocess

    from tests.conftest import PHI4

    result = subprocess.run(
        [
            PHI4,
            "solve",
            "-m",
            str(tiny_model),
            "-t",
            "0",
            "-n",
            "4",
            "-",
            "--each-line",
            "--answer-only",
        ],
        input=b"What is 1+1?\nWhat is \xc3(?\nWhat is 3+3?\n",
        capture_output=True,
        timeout=300,
    )
    assert result.returncode == 1
    stderr = result.stderr.decode()
    assert "line 2: stdin line 2 is not valid UTF-8 (byte 0xc3): convert it to UTF-8" in stderr
    assert "1 of 3 problems failed" in stderr
    assert len(result.stdout.decode().split("\n")) == 4  # three lines, each ended


@pytest.mark.daemon
def test_a_run_that_fails_ends_while_its_fifo_is_still_open(tmp_path: Path):
    # Before: closing the FIFO waited for the reader thread's read, so the error (no server)
    # came only when the writer closed its end.
    import subprocess

    from tests.conftest import PHI4, free_port

    fifo = tmp_path / "problems"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [
            PHI4,
            "solve",
            "--file",
            str(fifo),
            "-a",
            "--backend",
            f"http://127.0.0.1:{free_port()}/v1",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with open(fifo, "w") as writer:  # meets phi4's open of the other end
        writer.write("What is 1+1?\n")
        writer.flush()
        try:
            _out, err = proc.communicate(timeout=120)  # the writer is still open meanwhile
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 3, err
    assert "cannot reach" in err
