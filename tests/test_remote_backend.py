"""`--backend URL`: solve and chat against a real OpenAI-compatible server from another project
(llama-cpp-python's `llama_cpp.server`, on the tiny model), with no phi4 daemon involved."""

from __future__ import annotations

import email.utils
import gzip
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PHI4, free_port, run_phi4, start_llama_cpp_server
from tests.scripted_server import (
    Head,
    Step,
    chunk,
    data,
    never_accepting,
    scripted_server,
    separated,
)

# Each test runs phi4 as a process (the command, its daemon or a server).
pytestmark = pytest.mark.daemon


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> Iterator[str]:
    proc, url = start_llama_cpp_server(tiny_model)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_solve_through_a_remote_server_without_a_daemon(backend: str):
    result = run_phi4(
        "solve", "What is 12*13?", "--backend", backend, "-m", "tiny", "-t", "0", "-n", "8"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "starting the phi4 daemon" not in result.stderr
    assert run_phi4("status").returncode == 3, "no local daemon was started"
    record = json.loads(
        run_phi4("solve", "2+2?", "--backend", backend, "-m", "tiny", "-n", "4", "--json").stdout
    )
    assert record["solution"] and record["stats"]["completion_tokens"] == 4
    assert record["stats"]["finish_reason"] == "length"


def test_backend_from_env_and_reasoning_handling(backend: str):
    # A model named as a reasoning model: its text is thinking until </think>, as locally.
    result = run_phi4(
        "solve",
        "What is 12*13?",
        "-m",
        "tiny-reasoning",
        "-t",
        "0",
        "-n",
        "6",
        "--answer-only",
        env={"PHI4_BACKEND": backend},
    )
    assert result.returncode == 1
    assert "thinking did not finish" in result.stderr


def test_file_and_chat_through_a_remote_server(backend: str, tmp_path: Path):
    problems = tmp_path / "p.txt"
    problems.write_text("one\ntwo\n")
    batch = run_phi4(
        "solve", "-f", str(problems), "--jsonl", "--backend", backend, "-m", "tiny", "-n", "3"
    )
    assert batch.returncode == 0, batch.stderr
    assert [json.loads(line)["line"] for line in batch.stdout.splitlines()] == [1, 2]
    chat = run_phi4(
        "chat",
        "--backend",
        backend,
        "-m",
        "tiny",
        "-n",
        "3",
        input="hello\nand again\n/save remote\n",
    )
    assert chat.returncode == 0, chat.stderr
    assert "saved as remote" in chat.stderr  # (stdout piped: it holds the answers)


def test_unreachable_backend_is_one_line_and_exit_3():
    result = run_phi4("solve", "x", "--backend", "http://127.0.0.1:9/v1", "-m", "tiny")
    assert result.returncode == 3
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("phi4: error: cannot reach the backend http://127.0.0.1:9/v1:")


# --- a scripted server: how llama-server and vLLM stream, and every way a stream goes wrong -----

THINKING = ["Let me see: ", "12*13 ", "is 156."]
ANSWER = ["The answer is ", "$\\boxed{156}$."]


def _solve(url: str, *extra: str, env: dict[str, str] | None = None, timeout: float = 120) -> Any:
    return run_phi4(
        "solve",
        "What is 12*13?",
        "--backend",
        url,
        "-m",
        "phi4-mini-reasoning",
        *extra,
        env=env,
        timeout=timeout,
    )


@pytest.mark.parametrize("field_name", ["reasoning_content", "reasoning"])
def test_thinking_in_its_own_field_keeps_the_answer(field_name: str):
    # Before: phi4 waited for a </think> these servers had already removed, so the whole
    # solution was taken as thinking: empty stdout, no answer.
    with scripted_server(lambda _body: separated(field_name, THINKING, ANSWER)) as server:
        plain = _solve(server.url)
        assert plain.returncode == 0, plain.stderr
        assert plain.stdout.strip() == "The answer is $\\boxed{156}$."
        only = _solve(server.url, "--answer-only")
        assert (only.returncode, only.stdout) == (0, "156\n")
        record = json.loads(_solve(server.url, "--json").stdout)
        assert record["answer"] == "156"
        assert record["reasoning"] == "".join(THINKING)
        stats = record["stats"]
        # Real stats where the server sends usage: its counts, not guesses.
        assert (stats["prompt_tokens"], stats["completion_tokens"]) == (20, 5)
        assert (stats["reasoning_tokens"], stats["answer_tokens"]) == (3, 2)
        assert stats["thinking_unfinished"] is False
        chat = run_phi4(
            "chat", "--backend", server.url, "-m", "phi4-mini-reasoning", input="What is 12*13?\n"
        )
        assert chat.returncode == 0, chat.stderr
        assert "The answer is $\\boxed{156}$." in chat.stdout


def test_inline_thinking_is_still_split():
    def script(_body: dict[str, Any]) -> list[str | Step]:
        pieces = ["Let me see", "...</th", "ink>\n\nSo ", "$\\boxed{156}$."]
        return [chunk({"content": p}) for p in pieces] + [chunk({}, "stop"), data("[DONE]")]

    with scripted_server(script) as server:
        record = json.loads(_solve(server.url, "--json").stdout)
    assert (record["reasoning"], record["solution"]) == ("Let me see...", "So $\\boxed{156}$.")
    assert record["stats"]["reasoning_tokens"] == 2, "counted from the stream without usage"


def _failing(lines: list[str | Step]) -> Any:
    return lambda _body: [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "The answer"}),
        *lines,
    ]


@pytest.mark.parametrize(
    ("lines", "phrase"),
    [
        ([data("{not json")], "the backend sent a malformed event: '{not json'"),
        (
            [data({"error": {"message": "KV cache full", "code": 500}})],
            "the backend reported an error mid-answer: KV cache full",
        ),
        ([Step(drop=True)], "the backend closed the stream before the answer was complete"),
        ([Step(sleep=3)], "sent nothing for 1 s"),
    ],
    ids=["malformed-chunk", "in-stream-error", "dropped-connection", "stalled"],
)
def test_a_broken_stream_is_one_line_and_exit_5(lines: list[str | Step], phrase: str):
    # Before: a malformed chunk was "internal error: JSONDecodeError", exit 1; an in-stream error
    # was ignored (exit 0 with a partial answer).
    with scripted_server(_failing(lines)) as server:
        result = _solve(server.url, env={"PHI4_BACKEND_TIMEOUT": "1s"})
    assert result.returncode == 5, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("phi4: ")]
    assert errors == [errors[-1]] and phrase in errors[-1], result.stderr
    assert "Traceback" not in result.stderr


def test_an_answer_that_finished_is_kept_when_done_never_comes():
    # Before: a finish_reason, then silence instead of [DONE], was exit 5.
    def script(_body: dict[str, Any]) -> list[str | Step]:
        return [chunk({"content": "So $\\boxed{156}$."}), chunk({}, "stop"), Step(sleep=60)]

    with scripted_server(script) as server:
        result = _solve(server.url, "-m", "m", env={"PHI4_BACKEND_TIMEOUT": "1s"})
    assert (result.returncode, result.stdout) == (0, "So $\\boxed{156}$.\n"), result.stderr


def test_a_refusal_maps_to_its_exit_status():
    with scripted_server(lambda _body: [], status=400) as server:
        result = _solve(server.url)
    assert result.returncode == 1
    assert "the backend answered 400: scripted refusal" in result.stderr


def test_think_budget_is_enforced_for_a_remote_engine():
    # Before: --think-budget was dropped silently. Now the stream is cut at the budget and the
    # server is asked again with the thinking closed, as the start of the assistant's reply.
    def script(body: dict[str, Any]) -> list[str | Step]:
        if body["messages"][-1]["role"] == "assistant":
            return [
                chunk({"content": "So "}),
                chunk({"content": "$\\boxed{7}$."}),
                chunk({}, "stop"),
                data("[DONE]"),
            ]
        endless = [chunk({"reasoning_content": f"step {i}. "}) for i in range(50)]
        return [*endless, chunk({}, "length"), data("[DONE]")]

    with scripted_server(script) as server:
        record = json.loads(_solve(server.url, "--think-budget", "4", "--json").stdout)
        first, second = server.bodies
    assert record["answer"] == "7"
    assert record["reasoning"] == "step 0. step 1. step 2. step 3. "
    assert record["stats"]["budget_reached"] is True
    assert "think_budget" not in first, "no server knows the option"
    prefill = second["messages"][-1]
    assert prefill["role"] == "assistant"
    assert prefill["content"].endswith("step 3.\n</think>\n\n")
    assert second["continue_final_message"] is True


def test_zero_think_budget_skips_thinking_remotely():
    with scripted_server(
        lambda body: [chunk({"content": "$\\boxed{1}$"}), chunk({}, "stop"), data("[DONE]")]
    ) as server:
        only = _solve(server.url, "--think-budget", "0", "--answer-only")
        (body,) = server.bodies
    assert (only.returncode, only.stdout) == (0, "1\n")
    assert body["messages"][-1] == {"role": "assistant", "content": "<think>\n\n</think>\n\n"}


def test_think_budget_against_a_real_server(backend: str):
    # llama_cpp.server knows no think budget either: the stream is cut and asked again.
    record = json.loads(
        run_phi4(
            "solve",
            "What is 12*13?",
            "-m",
            "tiny-reasoning",
            "-t",
            "0",
            "-n",
            "12",
            "--think-budget",
            "3",
            "--json",
            "--backend",
            backend,
        ).stdout
    )
    stats = record["stats"]
    assert stats["budget_reached"] is True and stats["thinking_unfinished"] is False
    assert stats["reasoning_tokens"] == 3
    assert record["reasoning"] and record["solution"], "the answer came after the budget"


def test_samples_count_equal_answers_together():
    # Before: \frac12 and \frac{1}{2} were two answers, and one third won: "2/5 samples agree".
    # By seed, since the samples are asked at once: sample i has seed 10 + i.
    written = ["\\frac{1}{3}", "\\frac12", "\\frac{1}{3}", "\\dfrac{1}{2}", "\\frac{1}{2}"]

    def script(body: dict[str, Any]) -> list[str | Step]:
        answer = written[body["seed"] - 10]
        return separated("reasoning_content", ["Hmm."], [f"So $\\boxed{{{answer}}}$."])

    with scripted_server(script) as server:
        result = _solve(server.url, "--samples", "5", "--seed", "10", "--all")  # all five
    assert result.returncode == 0, result.stderr
    # One half, in its most common written form (\\dfrac and \\frac count as one form).
    # (Each answer to "What is 12*13?" fails its check: the vote is as it was, and says so.)
    assert result.stdout.splitlines()[-1] == (
        "Answer: \\dfrac{1}{2} (3/5 samples agree)  (\u2717 refuted: 12·13 = 156, not 1/2)"
    )


def test_samples_that_failed_are_said_not_silently_dropped():
    # Before: one sample's 500 and another's bad content printed nothing; the vote of what was
    # left read as if all three had answered.
    answers = iter(["ok", "fail", "ok"])
    lock = threading.Lock()

    def script(_body: dict[str, Any]) -> list[str | Step | Head]:
        with lock:
            which = next(answers)
        if which == "fail":
            return [Head(500), '{"error": {"message": "replica out of memory"}}']
        return separated("reasoning_content", ["Hmm."], ["So $\\boxed{156}$."])

    with scripted_server(script) as server:
        result = _solve(server.url, "--samples", "3", "--all")  # else 2 of 2 would settle it
    assert result.returncode == 0, result.stderr
    assert "1 of 3 samples failed and are not counted: " in result.stderr
    assert "replica out of memory" in result.stderr
    assert result.stdout.splitlines()[-1] == (
        "Answer: 156 (2/3 samples agree)  (\u2713 verified: 12·13 = 156)"
    )


def test_answer_only_lines_keep_their_input_lines(tmp_path: Path):
    def script(body: dict[str, Any]) -> list[str | Step]:
        question = body["messages"][-1]["content"].split("\n\n")[0]  # before the instruction
        a, b = (int(x) for x in question.removeprefix("What is ").rstrip("?").split("+"))
        return separated("reasoning_content", ["Add."], [f"$\\boxed{{{a + b}}}$"])

    problems = tmp_path / "gaps.txt"
    problems.write_text("What is 1+1?\n\n\nWhat is 2+2?\n\nWhat is 3+3?\n\n")
    with scripted_server(script) as server:
        result = run_phi4(
            "solve",
            "-f",
            str(problems),
            "--answer-only",
            "--backend",
            server.url,
            "-m",
            "phi4-mini-reasoning",
        )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n") == ["2", "", "", "4", "", "6", "", ""]


def test_solve_asks_for_a_boxed_answer_unless_told_not_to(phi4_home: Path):
    # The instruction Phi-4-mini-reasoning and DeepSeek-R1 were evaluated with.
    with scripted_server(lambda _body: separated("reasoning", ["Hm."], ["$\\boxed{4}$"])) as server:
        assert _solve(server.url).returncode == 0
        assert _solve(server.url, "--no-instruction").returncode == 0
        config = phi4_home / "config" / "config.toml"
        config.parent.mkdir(parents=True)
        config.write_text('instruction = "Answer in one word."\n')
        assert _solve(server.url).returncode == 0
        asked = [body["messages"][-1]["content"] for body in server.bodies]
    assert asked == [
        "What is 12*13?\n\nPlease reason step by step, and put your final answer within \\boxed{}.",
        "What is 12*13?",
        "What is 12*13?\n\nAnswer in one word.",
    ]


def test_eval_grades_answers_as_a_mathematician_would_and_resumes(tmp_path: Path):
    # Each problem's "model answer" is scripted: right, right in another form, wrong, unboxed.
    said = {"one half": "\\boxed{0.5}", "two": "\\boxed{2}", "three": "\\boxed{4}", "four": "four"}

    def script(body: dict[str, Any]) -> list[str | Step]:
        problem = body["messages"][-1]["content"].split("\n\n")[0]
        return separated("reasoning_content", ["Think."], [f"So ${said[problem]}$."])

    problems = tmp_path / "set.jsonl"
    problems.write_text(
        "".join(
            json.dumps(row) + "\n"
            for row in [
                {"problem": "one half", "answer": "\\frac{1}{2}"},
                {"problem": "two", "answer": "2"},
                {"problem": "three", "answer": "3"},
                {"problem": "four", "answer": "4"},
            ]
        )
    )
    args = ["eval", str(problems), "--backend", "URL", "-m", "phi4-mini-reasoning", "--json"]
    with scripted_server(script) as server:
        args[3] = server.url
        first = run_phi4(*args)
        assert first.returncode == 0, first.stderr
        result = json.loads(first.stdout)
        assert (result["problems"], result["correct"], result["wrong"], result["no_answer"]) == (
            4,
            2,
            1,
            1,
        )
        assert result["accuracy"] == 0.5
        # Appended as each finishes (problems are asked at once): in any order.
        records = sorted(
            (json.loads(line) for line in Path(result["results"]).read_text().splitlines()),
            key=lambda r: r["line"],
        )
        assert [(r["line"], r["status"]) for r in records] == [
            (1, "correct"),
            (2, "correct"),
            (3, "wrong"),
            (4, "no_answer"),
        ]
        sent = len(server.bodies)
        again = run_phi4(*args)  # everything is in the results file: nothing is sent again
        assert json.loads(again.stdout)["correct"] == 2
        assert len(server.bodies) == sent
        assert "resuming: 4 of 4 problems are already in" in again.stderr


def test_eval_with_samples_reports_pass_at_k_and_reads_csv(tmp_path: Path):
    # By problem, since all six samples are asked at once.
    answers = {
        "seven?": ["\\boxed{7}", "\\boxed{8}", "\\boxed{8}"],
        "five?": ["\\boxed{5}", "\\boxed{5}", "\\boxed{6}"],
    }
    lock = threading.Lock()

    def script(body: dict[str, Any]) -> list[str | Step]:
        with lock:
            answer = answers[body["messages"][-1]["content"].split("\n\n")[0]].pop()
        return separated("reasoning_content", ["Think."], [f"${answer}$"])

    problems = tmp_path / "set.csv"
    problems.write_text("question,solution\nseven?,7\nfive?,6\n")
    with scripted_server(script) as server:
        result = run_phi4(
            "eval",
            str(problems),
            "--problem-field",
            "question",
            "--answer-field",
            "solution",
            "-k",
            "3",
            "--all",  # pass@3 over all three
            "--backend",
            server.url,
            "-m",
            "phi4-mini",
        )
    assert result.returncode == 0, result.stderr
    table = dict(line.split(None, 1) for line in result.stdout.splitlines())
    assert table["problems"] == "2"
    assert table["correct"].startswith("0  (0.0%)"), "majorities: 8 for seven, 5 for five"
    assert table["pass@3"].startswith("2  (100.0%)"), "each had a right sample"


def test_eval_resumes_only_matching_records(tmp_path: Path):
    # Before: records of a -k 1 run were reused by -k 3, a corrected reference kept its old
    # verdict, and a damaged record ended in "internal error: KeyError".
    problems = tmp_path / "set.jsonl"
    problems.write_text('{"problem": "p1", "answer": "1"}\n{"problem": "p2", "answer": "2"}\n')
    results = tmp_path / "out.jsonl"

    def script(_body: dict[str, Any]) -> list[str | Step]:
        return separated("reasoning_content", ["Think."], ["$\\boxed{1}$"])

    with scripted_server(script) as server:
        base = [
            "eval",
            str(problems),
            "--backend",
            server.url,
            "-m",
            "m",
            "-o",
            str(results),
            "--json",
        ]
        assert json.loads(run_phi4(*base).stdout)["correct"] == 1
        sent = len(server.bodies)
        other_k = run_phi4(*base, "-k", "3", "--all")
        assert other_k.returncode == 1 and "(samples 1, not 3)" in other_k.stderr
        assert len(server.bodies) == sent, "another run's file: nothing is solved"
        restarted = run_phi4(*base, "-k", "3", "--all", "--restart")
        assert json.loads(restarted.stdout)["pass_at_k_count"] == 1
        assert len(server.bodies) == sent + 6, "other samples: solved again"
        problems.write_text('{"problem": "p1", "answer": "1"}\n{"problem": "p2", "answer": "1"}\n')
        assert json.loads(run_phi4(*base, "-k", "3", "--all").stdout)["correct"] == 2, "judged anew"
        assert len(server.bodies) == sent + 9, "only the problem with a new reference"
        run = json.loads(results.read_text().splitlines()[0])["run"]
        with results.open("a") as handle:
            handle.write(json.dumps({"line": 1, "problem": "p1", "run": run}) + "\n")  # no status
        again = run_phi4(*base, "-k", "3", "--all")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["correct"] == 2


# --- a hostile engine: nothing it sends can hang, bloat or crash the client --------------------

# Runs a command and reports, as its last stderr line, the peak memory of that command (KiB).
_MEASURED = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
    "print('maxrss-kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
    "file=sys.stderr); sys.exit(code)"
)
RSS_BOUND_KIB = 256 * 1024  # generous: the client peaks near 40 MiB here; before, 3.2 GB


def _solve_measured(url: str, *extra: str, env: dict[str, str]) -> tuple[Any, int]:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _MEASURED,
            PHI4,
            "solve",
            "What is 12*13?",
            "--backend",
            url,
            "-m",
            "m",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **env},
        check=False,
    )
    *lines, last = result.stderr.splitlines()
    assert last.startswith("maxrss-kib "), result.stderr
    result.stderr = "\n".join(lines)
    return result, int(last.split()[1])


def _one_error_line(result: Any) -> str:
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("phi4: error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_an_endless_error_body_is_read_to_a_bound_and_shown_as_one_clean_line():
    # Before: the whole body was read (3.2 GB of RSS in 40 s) and shown raw.
    def script(_body: dict[str, Any]) -> Iterator[str | Step | Head]:
        yield Head(500, {"Content-Type": "text/plain"})
        yield "out of memory\x1b]52;c;cm0gLXJmIH4K\x07\r\n\u202eevil\n"
        for _ in range(100_000):  # 6.5 GB, if it were all read
            yield "x" * 65536

    with scripted_server(script) as server:
        result, rss_kib = _solve_measured(server.url, env={"PHI4_BACKEND_TIMEOUT": "5s"})
    assert result.returncode == 5, result.stderr
    line = _one_error_line(result)
    assert line.startswith("phi4: error: the backend answered 500: out of memory\ufffd"), line
    assert len(line) < 300 and line.endswith("…")
    assert not any(ch in line for ch in "\x1b\x07\r\u202e")
    assert rss_kib < RSS_BOUND_KIB


def test_an_engine_that_ignores_max_tokens_is_cut_as_a_length_stop():
    # Before: an endless stream was read forever (no client-side max_tokens).
    def script(body: dict[str, Any]) -> Iterator[str | Step | Head]:
        assert body["max_tokens"] == 20, "still asked of the server"
        for i in range(1_000_000):
            yield chunk({"content": f"w{i} "})

    with scripted_server(script) as server:
        result = _solve(server.url, "-n", "20", "--json", env={"PHI4_BACKEND_TIMEOUT": "5s"})
    record = json.loads(result.stdout)
    assert record["stats"]["finish_reason"] == "length"
    assert record["stats"]["completion_tokens"] == 20
    assert record["reasoning"] + record["solution"] == "".join(f"w{i} " for i in range(20))


def test_a_trickling_server_ends_by_the_silence_timeout():
    # One byte at a time, never a whole event: before, this never ended.
    def script(_body: dict[str, Any]) -> Iterator[str | Step | Head]:
        yield chunk({"content": "The answer"})
        for _ in range(600):  # five minutes, if nothing stopped it
            yield "d"
            yield Step(sleep=0.5)

    with scripted_server(script) as server:
        result = _solve(server.url, env={"PHI4_BACKEND_TIMEOUT": "2s"})
    assert result.returncode == 5, result.stderr
    assert "sent nothing for 2 s" in _one_error_line(result)


def test_a_stream_that_never_finishes_ends_at_the_total_deadline():
    # Whole events, each in time, but no end: the deadline of the whole request stops it.
    def script(_body: dict[str, Any]) -> Iterator[str | Step | Head]:
        for _ in range(600):
            yield chunk({})
            yield Step(sleep=0.2)

    with scripted_server(script) as server:
        result = _solve(
            server.url, env={"PHI4_BACKEND_TIMEOUT": "5s", "PHI4_BACKEND_DEADLINE": "2s"}
        )
    assert result.returncode == 5, result.stderr
    assert "took more than 2 s in all (PHI4_BACKEND_DEADLINE" in _one_error_line(result)


def test_a_stream_silent_past_the_deadline_ends_at_the_deadline():
    # A read waiting on a silent socket cannot look at the clock: the guard hangs up for it.
    def script(_body: dict[str, Any]) -> list[str | Step | Head]:
        return [chunk({"content": "The answer"}), Step(sleep=60)]

    with scripted_server(script) as server:
        result = _solve(
            server.url,
            env={"PHI4_BACKEND_TIMEOUT": "30s", "PHI4_BACKEND_DEADLINE": "2s"},
            timeout=25,
        )
    assert result.returncode == 5, result.stderr
    assert "took more than 2 s in all" in _one_error_line(result)


def test_a_server_that_trickles_its_status_line_is_unreachable_exit_3():
    # Bytes keep coming, so httpx's read timeout never fires; no answer ever starts.
    def script(_body: dict[str, Any]) -> Iterator[str | Step | Head]:
        yield Head(200, raw=True)
        yield "HTTP/1.1 200 OK\r\n"
        for _ in range(600):
            yield "X"
            yield Step(sleep=0.25)

    with scripted_server(script) as server:
        result = _solve(server.url, env={"PHI4_BACKEND_TIMEOUT": "2s"})
    assert result.returncode == 3, result.stderr
    assert "took the connection but did not answer for 2 s" in _one_error_line(result)


@pytest.mark.parametrize(
    ("pieces", "phrase"),
    [
        (["data: " + "x" * (2 * 2**20)], "Server-sent event exceeded the 1048576 byte limit"),
        ((chunk({}, pad="y" * 900_000) for _ in range(100)), "sent more than 64 MiB"),
    ],
    ids=["one-endless-line", "endless-big-events"],
)
def test_an_oversized_event_or_stream_is_refused_in_bounded_memory(pieces: Any, phrase: str):
    with scripted_server(lambda _body: pieces) as server:
        result, rss_kib = _solve_measured(server.url, env={"PHI4_BACKEND_TIMEOUT": "5s"})
    assert result.returncode == 5, result.stderr
    assert phrase in _one_error_line(result)
    assert rss_kib < RSS_BOUND_KIB


def test_a_compressed_answer_is_refused_before_it_is_inflated():
    # 64 KiB of gzip that would inflate to 64 MiB in one read, and on and on.
    bomb = gzip.compress(b"data: " + b"x" * (64 * 2**20))

    def script(_body: dict[str, Any]) -> Iterator[str | bytes | Step | Head]:
        yield Head(200, {"Content-Encoding": "gzip"})
        yield bomb

    with scripted_server(script) as server:
        result, rss_kib = _solve_measured(server.url, env={"PHI4_BACKEND_TIMEOUT": "5s"})
    assert result.returncode == 5, result.stderr
    assert "sent a compressed answer (gzip), which phi4 did not ask for" in (
        _one_error_line(result)
    )
    assert rss_kib < RSS_BOUND_KIB


_NAN = float("nan")


@pytest.mark.parametrize(
    "extra",
    [
        {
            "usage": {
                "prompt_tokens": "many",
                "completion_tokens": _NAN,
                "completion_tokens_details": {"reasoning_tokens": 1e300},
                "prompt_tokens_details": "none",
            }
        },
        {
            "usage": {
                "prompt_tokens": -5,
                "completion_tokens": float("inf"),
                "completion_tokens_details": [1],
            },
            "timings": {"prompt_ms": "fast", "predicted_ms": -1, "cache_n": _NAN, "prompt_n": {}},
        },
        {"usage": [], "timings": {"prompt_ms": float("inf"), "predicted_ms": 1e308}},
        {"usage": {"completion_tokens": True, "prompt_tokens": 10**30}},
    ],
    ids=["strings-nan-huge", "negative-inf-lists", "not-objects", "bool-and-huge-int"],
)
def test_wrong_typed_stats_are_ignored(extra: dict[str, Any]):
    # Before: ValueError, OverflowError or TypeError, shown as "internal error".
    def script(_body: dict[str, Any]) -> list[str | Step | Head]:
        return [
            chunk({"content": "So "}),
            chunk({"content": "$\\boxed{156}$."}),
            chunk({}, "stop", **extra),
            data("[DONE]"),
        ]

    with scripted_server(script) as server:
        result = _solve(server.url, "--json", "-m", "m")  # not a reasoning model: all answer
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)["stats"]
    assert stats["completion_tokens"] == 2, "counted from the stream"
    assert stats["prompt_tokens"] == 0 and stats["cached_tokens"] == 0
    assert all(
        math.isfinite(stats[key]) and stats[key] >= 0
        for key in ("prompt_eval_s", "decode_s", "total_s")
    )


_MALFORMED = "the backend sent a malformed event"


@pytest.mark.parametrize(
    ("line", "phrase"),
    [
        (data({"choices": {"delta": {}}}), "sent 'choices' that are not a list of objects"),
        (data({"choices": ["text"]}), "sent 'choices' that are not a list of objects"),
        (chunk(["not", "a", "delta"]), "sent a 'delta' that is not an object"),  # type: ignore[arg-type]
        (chunk({"content": 156}), "sent a 'content' that is not text"),
        (chunk({"reasoning_content": {"a": 1}}), "sent a 'reasoning_content' that is not text"),
        (chunk({}, 7), "sent a finish_reason that is not text"),  # type: ignore[arg-type]
        (data('{"usage": {"prompt_tokens": ' + "9" * 5000 + "}}"), _MALFORMED),
        (data("[" * 100_000 + "]" * 100_000), _MALFORMED),
        (
            data({"error": {"message": ["a", "\x1b[2J"], "code": 1e999}}),
            'reported an error mid-answer: ["a", "\\u001b[2J"]',
        ),
    ],
    ids=[
        "choices-object",
        "choice-string",
        "delta-list",
        "content-number",
        "reasoning-object",
        "finish-number",
        "digits-past-int-limit",
        "deep-nesting",
        "error-not-text",
    ],
)
def test_wrong_typed_content_is_one_line_naming_the_engine_and_exit_5(line: str, phrase: str):
    with scripted_server(_failing([line])) as server:
        result = _solve(server.url)
    assert result.returncode == 5, result.stderr
    error = _one_error_line(result)
    assert phrase in error, error
    if phrase.startswith("sent "):
        assert f"the backend {server.url} {phrase}" in error


def test_a_server_that_never_takes_the_connection_is_unreachable_exit_3():
    # Before: exit 5 after 10.5 s, "sent nothing for 300 s".
    with never_accepting(backlog_full=True) as url:
        result = _solve(url, env={"PHI4_BACKEND_TIMEOUT": "1s"})
    assert result.returncode == 3, result.stderr
    line = _one_error_line(result)
    assert (
        line
        == f"phi4: error: cannot reach the backend {url}: it did not take the connection in time"
    )


def test_a_server_that_takes_the_connection_but_never_answers_is_unreachable_exit_3():
    with never_accepting(backlog_full=False) as url:
        result = _solve(url, env={"PHI4_BACKEND_TIMEOUT": "1s"})
    assert result.returncode == 3, result.stderr
    assert f"the backend {url} took the connection but did not answer for 1 s" in (
        _one_error_line(result)
    )


def test_a_refused_connection_is_unreachable_exit_3():
    port = free_port()  # closed again: nothing listens there
    # Waits longer than a socket timeout can hold are taken as the longest that fits.
    result = _solve(
        f"http://127.0.0.1:{port}/v1",
        env={
            "PHI4_BACKEND_TIMEOUT": "99999999999999999999s",
            "PHI4_BACKEND_DEADLINE": "99999999999999999999s",
        },
    )
    assert result.returncode == 3, result.stderr
    assert f"cannot reach the backend http://127.0.0.1:{port}/v1" in _one_error_line(result)


def _busy_then(statuses: list[tuple[int, dict[str, str]]]) -> Any:
    """A script that refuses with each (status, headers) in turn, then answers."""
    refusals = iter(statuses)

    def script(_body: dict[str, Any]) -> list[str | Step | Head]:
        refusal = next(refusals, None)
        if refusal is not None:
            return [
                Head(refusal[0], {"Content-Type": "application/json", **refusal[1]}),
                json.dumps({"error": {"message": "busy, try later"}}),
            ]
        return separated("reasoning_content", ["Hm."], ["$\\boxed{156}$"])

    return script


@pytest.mark.parametrize(
    "retry_after",
    ["1", "__date__", None],
    ids=["seconds", "http-date", "no-header"],
)
def test_429_and_503_are_asked_again_after_retry_after(retry_after: str | None):
    # Before: Retry-After was ignored and the first refusal ended the command.
    if retry_after == "__date__":
        retry_after = email.utils.formatdate(time.time() + 1, usegmt=True)
    headers = {"Retry-After": retry_after} if retry_after else {}
    with scripted_server(_busy_then([(429, headers), (503, headers)])) as server:
        result = _solve(server.url, "--answer-only")
        asked = len(server.bodies)
    assert (result.returncode, result.stdout) == (0, "156\n"), result.stderr
    assert asked == 3
    notices = [line for line in result.stderr.splitlines() if "is busy" in line]
    assert len(notices) == 1 and notices[0].startswith(
        f"phi4: the backend {server.url} is busy (429); asking again in "
    ), result.stderr


def test_a_server_busy_for_good_ends_after_a_bounded_number_of_retries():
    with scripted_server(_busy_then([(503, {"Retry-After": "0"})] * 10)) as server:
        result = _solve(server.url)
        asked = len(server.bodies)
    assert asked == 4, "the first request and three more"
    assert result.returncode == 3, result.stderr
    assert "the backend answered 503: busy, try later" in _one_error_line(result)


def test_a_retry_after_beyond_the_bound_is_not_waited_for():
    with scripted_server(_busy_then([(429, {"Retry-After": "3600"})])) as server:
        result = _solve(server.url)
        asked = len(server.bodies)
    assert asked == 1
    assert result.returncode == 1, result.stderr
    assert "the backend answered 429: busy, try later" in _one_error_line(result)


def test_a_remote_prompt_found_cached_is_not_counted_as_evaluated():
    # Before: "prompt tokens: 50 (49 cached, 50 evaluated)" against phi4 serve, whose usage
    # says what was cached but gives no llama-server timings; and "seed None" in the footer.
    def script(_body: dict[str, Any]) -> list[str | Step | Head]:
        usage = {
            "prompt_tokens": 50,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 49},
        }
        return [
            chunk({"content": "So "}),
            chunk({"content": "$\\boxed{4}$."}),
            chunk({}, "stop"),
            data({"choices": [], "usage": usage}),
            data("[DONE]"),
        ]

    with scripted_server(script) as server:
        result = _solve(server.url, "--json", "-m", "m")
        shown = _solve(server.url, "-v", "-m", "m")
    stats = json.loads(result.stdout)["stats"]
    assert (stats["prompt_tokens"], stats["cached_tokens"], stats["prompt_eval_tokens"]) == (
        50,
        49,
        1,
    )
    assert "50 (49 cached, 1 evaluated)" in shown.stderr, shown.stderr
    assert "seed None" not in shown.stderr
