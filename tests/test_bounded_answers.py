"""Answer work takes bounded time whatever the model (or a remote engine) writes: extraction,
votes, grades and the terminal's LaTeX view; an empty ``\\boxed{}`` is no answer anywhere.

The pathological answers are those a hostile engine sent: 28 KB of nested ``\\boxed{``
(41 s for ``--answer-only``), ``1000000!`` and ``9^{9^{9^{9}}}`` in a vote (34 s, and a
"Timeout during comparison" line per pair), 2,000 nested powers at a terminal (38 s). Each test
has a small ``timeout`` marker: before the fixes, each ran far past it."""

from __future__ import annotations

import itertools
import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from phi4cli.backends.outcome import Outcome, exit_status
from phi4cli.core.protocol import Event, EventKind
from phi4cli.text.latex import latex_to_unicode, math_to_unicode
from phi4cli.text.reasoning import (
    AnswerComparer,
    ComparisonTooCostly,
    ThinkSplitter,
    _within_budget,
    boxed_answers,
    braced_group,
    extract_final_answer,
    majority_vote,
    same_answer,
    symbolic_too_costly,
)
from tests.conftest import run_phi4
from tests.scripted_server import Step, chunk, data, scripted_server, separated

NOTICE = "answer comparisons were too costly; compared them as text"
HUGE = ["1000000!", "9^{9^{9^{9}}}", "10^{10^{10}}", "2^{10^{6}}", "99999999!"]


# --- extraction: linear in the text -------------------------------------------------------------


@pytest.mark.timeout(20)
@pytest.mark.parametrize("size", [56_000, 200_000])
def test_extraction_of_nested_and_unbalanced_boxes_is_linear(size: int):
    opened = "\\boxed{" * (size // 7)  # never closed: each box scanned to the end, before
    assert extract_final_answer(opened) is None
    depth = size // 14
    nested = "\\boxed{" * depth + "42" + "}" * depth
    assert extract_final_answer(nested) == "42"
    assert len(boxed_answers("\\boxed{" * 500 + "1" + "}" * 500)) == 500
    braces = "{" * size + "\\boxed{7}"
    assert extract_final_answer(braces) == "7"
    assert extract_final_answer("}" * size + "\\boxed{" + "{" * size) is None
    assert extract_final_answer("\\boxed " * (size // 7) + "\\boxed 9") == "9"  # bare forms
    assert braced_group("{a{b}c}", 0) == "a{b}c"
    assert braced_group("{a\\}b}", 0) == "a\\}b"
    assert braced_group("{open", 0) is None


@pytest.mark.timeout(30)
def test_text_streamed_in_small_pieces_is_folded_in_linear_time():
    # Before: each piece copied all the text before it (a str's += on an attribute), so 16 MiB
    # in 512-byte pieces took minutes (4 MiB through `solve --backend`: 24 s; 64 MiB, the most
    # a remote answer may be, about an hour); and so did as many blanks before any text.
    piece, count = "abcdefgh " * 56 + "\n", 32_768
    outcome, splitter, blanks = Outcome(0, "q"), ThinkSplitter(), ThinkSplitter()
    for _ in range(count):
        outcome.apply(Event(EventKind.REASONING, text=piece))
        outcome.apply(Event(EventKind.TOKEN, text=piece))
        splitter.feed(piece)
        blanks.feed(" " * len(piece))
    outcome.apply(Event(EventKind.TOKEN, text="\\boxed{4}"))
    assert len(outcome.reasoning) == count * len(piece) == len(splitter.answer)
    assert outcome.answer == "4"
    assert blanks.feed("<think>so</think>4") == [("reasoning", "so"), ("answer", "4")]
    assert splitter.feed("</think>x") == [("retract", ""), ("answer", "x")]
    assert (len(splitter.reasoning), splitter.answer) == (count * len(piece), "x")
    leading = ThinkSplitter()  # blanks before an answer are kept, as before
    assert [leading.feed(text) for text in ("  ", " \n", "ok")] == [[], [], [("answer", "   \nok")]]


def test_outcome_answer_is_extracted_once_per_solution():
    outcome = Outcome(0, "q")
    outcome.apply(Event(EventKind.TOKEN, text="so \\boxed{"))
    assert outcome.answer is None
    outcome.apply(Event(EventKind.TOKEN, text="5}"))
    assert outcome.answer == "5"


# --- an empty box states nothing -----------------------------------------------------------------


@pytest.mark.parametrize(
    "solution",
    [
        "\\boxed{}",
        "So $\\boxed{ }$.",
        "\\boxed{\\,}",
        "\\boxed{\\boxed{}}",
        "\\boxed{$$}",
        "The final answer is $\\boxed{}$.",
    ],
)
def test_an_empty_box_is_no_answer(solution: str):
    assert extract_final_answer(solution) is None
    outcome = Outcome(0, "q")
    outcome.apply(Event(EventKind.TOKEN, text=solution))
    assert outcome.to_json()["answer"] is None
    assert exit_status([outcome], answer_required=True) == 1


def test_the_last_box_that_holds_something_wins():
    assert extract_final_answer("\\boxed{3}, then \\boxed{5} and \\boxed{}") == "5"
    assert extract_final_answer("\\boxed{ 5 }") == "5"
    vote = majority_vote(["", None, None])
    assert vote.answer is None and vote.votes == 0


# --- comparisons: a pre-check, a budget in any thread, one count ---------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        *HUGE,
        "9^9^9",
        "9**9**9",
        "(10^6)!",
        "2^{99999 \\times 99999}",
        "10^{100000}",
        "\\binom{10000000}{5000000}",
        "x" * 300,
        "(" * 20 + "1" + ")" * 20,
        "(2^{9999})^{9999}",
        "1000!^{1000}",
        "((2^{9999})^{10})^{10}",
    ],
)
def test_answers_sympy_would_compute_forever_are_compared_as_text(answer: str):
    assert symbolic_too_costly(answer)


@pytest.mark.parametrize(
    "answer",
    [
        "2^{2023}",
        "5!",
        "n!",
        "(2n)!",
        "e^{x^2}",
        "x^{y^{z}}",
        "2^{-1/2}",
        "3^{\\frac{1}{2}}",
        "\\frac{\\sqrt{3}}{2}",
        "2^3 \\cdot 3^2",
        "e^{i\\pi}",
        "x = 2 \\text{ or } x = 3",
        "10^{6}",
        "(2^3)^2",
        "5!^2",
        "(x^2)^{3}",
        "n!^2",
    ],
)
def test_ordinary_answers_are_still_compared_as_mathematics(answer: str):
    assert not symbolic_too_costly(answer)


@pytest.mark.timeout(30)
def test_a_vote_over_huge_answers_counts_its_text_comparisons():
    compare = AnswerComparer()
    vote = majority_vote([*HUGE, *HUGE], equal=compare)
    assert vote.votes == 2 and vote.answer == HUGE[0]
    assert compare.as_text > 0
    assert compare.notice() == f"{compare.as_text} {NOTICE}"
    assert AnswerComparer().notice() is None
    assert compare("0.5", "\\frac{1}{2}"), "real answers still compared by math-verify"
    assert not compare("3", "4")


def test_math_verify_compares_off_the_main_thread_too():
    # Before: math-verify's signal-based timeout raised ValueError in a thread, so every
    # comparison there was silently "not the same".
    found: list[bool] = []
    worker = threading.Thread(target=lambda: found.append(same_answer("0.5", "\\frac{1}{2}")))
    worker.start()
    worker.join(60)
    assert found == [True]


def _spin() -> bool:
    while True:
        pass


@pytest.mark.timeout(60)
def test_the_budget_interrupts_a_long_comparison_in_any_thread():
    with pytest.raises(ComparisonTooCostly):
        _within_budget(0.05, _spin)
    caught: list[BaseException] = []

    def in_thread() -> None:
        try:
            _within_budget(0.05, _spin)
        except ComparisonTooCostly as exc:
            caught.append(exc)

    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join(50)
    assert len(caught) == 1
    assert _within_budget(5.0, lambda: True) is True


@pytest.mark.timeout(120)
def test_no_interruption_escapes_a_budget_that_races_the_end_of_its_work():
    import sys

    def work() -> bool:
        total = 0
        for i in range(30_000):
            total += i
        return True

    def race(outcomes: list[str]) -> None:
        for _ in range(300):
            try:
                outcomes.append(str(_within_budget(0.001, work)))
            except ComparisonTooCostly:
                outcomes.append("over")
            for _ in range(20_000):  # an interruption still pending would land here
                pass

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.00005)  # threads switch often: the race is run, not avoided
    try:
        here: list[str] = []
        race(here)
        there: list[str] = []
        worker = threading.Thread(target=race, args=(there,))
        worker.start()
        worker.join(100)
    finally:
        sys.setswitchinterval(interval)
    assert len(here) == len(there) == 300
    assert set(here) | set(there) <= {"True", "over"}


@pytest.mark.timeout(60)
def test_a_comparison_past_its_budget_is_text_and_counted(monkeypatch: pytest.MonkeyPatch):
    import phi4cli.text.reasoning as reasoning

    monkeypatch.setattr(reasoning, "_verified", lambda _verify, _a, _b: _spin())
    compare = AnswerComparer(budget_s=0.05)
    assert not compare("x + 1", "1 + x")
    assert not compare("x + 1", "y")  # x + 1 ran out once: text from then on, no second wait
    assert compare.as_text == 2


def test_math_verify_logs_nothing_per_pair():
    AnswerComparer()("\\frac{1}{3}", "0.3333")
    assert not logging.getLogger("math_verify.grader").isEnabledFor(logging.WARNING)
    assert not logging.getLogger("math_verify.parser").isEnabledFor(logging.WARNING)


# --- the terminal's LaTeX view -------------------------------------------------------------------


@pytest.mark.timeout(20)
def test_two_thousand_nested_powers_render_as_written():
    powers = "\\boxed{" + "2^{" * 2000 + "2" + "}" * 2000 + "}"
    assert latex_to_unicode(powers) == powers
    assert latex_to_unicode("\\boxed{" * 30_000) == "\\boxed{" * 30_000
    for unclosed in ("\\[", "\\("):  # a lazy regex rescanned from each one: quadratic
        assert latex_to_unicode(unclosed * 40_000 + "$x^2$") == unclosed * 40_000 + "x²"
    roots = "\\sqrt[" * 15_000  # each sought its "]" to the end
    assert latex_to_unicode(roots) == roots
    many = " ".join("$" + "2^{" * 20 + str(i) + "}" * 20 + "$" for i in range(2000))
    assert latex_to_unicode(many) == many, "past the conversion budget: as written"
    assert math_to_unicode("2^{" * 100 + "}" * 100) == "2^{" * 100 + "}" * 100
    assert latex_to_unicode("$2^{2^{2}}$ and \\boxed{\\frac{1}{2}}") == "2^(2²) and 1/2"


# --- through the real CLI, against a scripted engine ---------------------------------------------


def _answers(*answers: str) -> Any:
    """A script whose Nth request is answered with the Nth of ``answers`` (cycling)."""
    lock = threading.Lock()
    cycle = itertools.cycle(answers)

    def script(_body: dict[str, Any]) -> list[str | Step]:
        with lock:
            answer = next(cycle)
        return separated("reasoning_content", ["Think."], [f"So ${answer}$."])

    return script


def _notices(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if NOTICE in line]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("samples", [3, 5])
@pytest.mark.daemon
def test_samples_of_huge_answers_vote_at_once_with_one_notice(samples: int):
    boxed = [f"\\boxed{{{answer}}}" for answer in HUGE]
    with scripted_server(_answers(*boxed)) as server:
        result = run_phi4(
            "solve",
            "What is big?",
            "--backend",
            server.url,
            "-m",
            "m",
            "-k",
            str(samples),
            "--json",
            timeout=60,
        )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    # The samples may reach the engine in any order: which sample got which answer may vary.
    assert sorted(s["answer"] for s in record["samples"]) == sorted(HUGE[:samples])
    assert record["agreement"] == f"1/{samples}"
    assert len(_notices(result.stderr)) == 1, result.stderr
    assert "Timeout during comparison" not in result.stderr


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_eval_of_a_huge_answer_grades_at_once_with_one_notice(tmp_path: Path):
    problems = tmp_path / "huge.jsonl"
    rows = [
        {"problem": "big?", "answer": "9^{9^{9^{9}}}"},
        {"problem": "bigger?", "answer": "1000000!"},
    ]
    problems.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # Each problem's samples: two of one answer, one of another, in whatever order they come, so
    # the majority is the same whatever the order: right for "big?", wrong for "bigger?".
    said = {
        "big?": ["9^{9^{9^{9}}}", "9^{9^{9^{9}}}", "1000000!"],
        "bigger?": ["10^{10^{10}}", "1000000!", "10^{10^{10}}"],
    }
    lock = threading.Lock()

    def script(body: dict[str, Any]) -> list[str | Step]:
        question = body["messages"][-1]["content"].split("\n\n")[0]
        with lock:
            answer = said[question].pop()
        return separated("reasoning_content", ["Think."], [f"So $\\boxed{{{answer}}}$."])

    with scripted_server(script) as server:
        # --all: pass@3 is over all three samples (two agreeing would settle the vote)
        result = run_phi4(
            "eval",
            str(problems),
            "-k",
            "3",
            "--all",
            "--backend",
            server.url,
            "-m",
            "m",
            "--json",
            timeout=60,
        )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["problems"], summary["correct"], summary["pass_at_k_count"]) == (2, 1, 2)
    assert len(_notices(result.stderr)) == 1, result.stderr
    assert "Timeout during comparison" not in result.stderr


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_megabytes_of_blanks_in_small_pieces_are_read_at_once():
    # Before: 4 MiB of spaces in 256-byte pieces took 24 s (each piece copied and stripped all
    # those before it), 8 MiB four times that; now about a second.
    def script(_body: dict[str, Any]) -> Any:
        yield chunk({"role": "assistant", "content": ""})
        line = chunk({"content": " " * 256})
        for _ in range(8 * 4096):
            yield line
        yield chunk({"content": "<think>so</think>\\boxed{4}"})
        yield chunk({}, "stop")
        yield data("[DONE]")

    with scripted_server(script) as server:
        result = run_phi4(
            "solve",
            "q",
            "--backend",
            server.url,
            "-m",
            "m",
            "-a",
            "--max-tokens",
            "100000",
            timeout=40,
        )
    assert (result.returncode, result.stdout) == (0, "4\n"), result.stderr


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_answer_only_of_56_kb_of_nested_boxes_is_quick():
    # Before: 28 KB took 41 s, and 56 KB four times that (quadratic); now about a second.
    # (--loop off: such an answer is a loop, which would stop it before the extraction.)
    with scripted_server(_answers("\\boxed{" * 8_000)) as server:
        result = run_phi4(
            "solve", "q", "--backend", server.url, "-m", "m", "-a", "--loop", "off", timeout=30
        )
    assert (result.returncode, result.stdout) == (1, "\n")
    assert "no final answer stated in the solution" in result.stderr


@pytest.mark.timeout(120)
@pytest.mark.daemon
def test_an_empty_box_is_no_answer_in_every_mode(tmp_path: Path):
    # Before: the answer "" — a blank line, exit 0, no reason; in --samples one "" and the
    # others null.
    with scripted_server(_answers("\\boxed{}")) as server:
        only = run_phi4("solve", "q", "--backend", server.url, "-m", "m", "-a")
        record = json.loads(
            run_phi4("solve", "q", "--backend", server.url, "-m", "m", "--json").stdout
        )
    assert (only.returncode, only.stdout) == (1, "\n")
    assert "phi4: no final answer stated in the solution" in only.stderr
    assert record["answer"] is None
    with scripted_server(_answers("\\boxed{}", "no box", "nothing")) as server:
        voted = run_phi4("solve", "q", "--backend", server.url, "-m", "m", "-k", "3", "--json")
        server_answers = run_phi4("solve", "q", "--backend", server.url, "-m", "m", "-k", "3", "-a")
    samples = json.loads(voted.stdout)
    assert samples["answer"] is None
    assert [s["answer"] for s in samples["samples"]] == [None, None, None]
    assert (server_answers.returncode, server_answers.stdout) == (1, "\n")
    assert "no final answer" in server_answers.stderr
    lines = tmp_path / "p.txt"
    lines.write_text("one\ntwo\n")
    said = {"one": "\\boxed{}", "two": "\\boxed{2}"}  # by question: the two may come in any order

    def by_question(body: dict[str, Any]) -> list[str | Step]:
        question = body["messages"][-1]["content"].split("\n\n")[0]
        return separated("reasoning_content", ["Think."], [f"So ${said[question]}$."])

    with scripted_server(by_question) as server:
        batch = run_phi4("solve", "-f", str(lines), "-a", "--backend", server.url, "-m", "m")
    assert (batch.returncode, batch.stdout) == (1, "\n2\n")
    assert "line 1: no final answer stated in the solution" in batch.stderr
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"problem": "q", "answer": "3"}) + "\n")
    with scripted_server(_answers("\\boxed{ }")) as server:
        graded = run_phi4("eval", str(problems), "--backend", server.url, "-m", "m", "--json")
    assert json.loads(graded.stdout)["no_answer"] == 1, graded.stderr


@pytest.mark.timeout(10)  # before: 22 s to 38 s; now well under a second
def test_the_terminal_view_of_two_thousand_nested_powers_is_quick():
    import io

    from rich.console import Console

    from phi4cli.client.presenters import TerminalPresenter

    presenter = TerminalPresenter(show_reasoning=False, verbose=False)
    buffer = io.StringIO()
    presenter.out = Console(file=buffer, force_terminal=True, width=80, highlight=False)
    presenter.err = Console(file=io.StringIO(), force_terminal=True, width=80)
    powers = "2^{" * 2000 + "2" + "}" * 2000
    outcome = Outcome(index=0, question="q")
    for piece in ["So $\\boxed{", powers[:3000], powers[3000:], "}$."]:
        event = Event(EventKind.TOKEN, text=piece)
        outcome.apply(event)
        presenter.on_event(event)
    presenter.finish(outcome)
    assert outcome.answer == powers
    shown = buffer.getvalue().split("\x1b[?25h")[-1]
    assert "Answer:" in shown and "2^{2^{2^{" in shown, "shown as written, not converted"


@pytest.mark.timeout(20)
def test_a_vote_of_64_long_distinct_answers_is_quick():
    # Before: each pair normalised both answers again: 64 answers of 100 KB took 13 s.
    answers = [f"{i}" + "x+" * 50_000 for i in range(64)]
    compare = AnswerComparer()
    vote = majority_vote(answers, equal=compare)
    assert (vote.votes, vote.total, vote.answer) == (1, 64, answers[0])
    assert compare.as_text == 64 * 63 // 2
