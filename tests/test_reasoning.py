"""Unit tests: the streaming <think> splitter, final-answer extraction, voting, LaTeX rendering."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from phi4cli.text.latex import latex_to_unicode, math_to_unicode
from phi4cli.text.reasoning import (
    ThinkSplitter,
    boxed_answers,
    extract_final_answer,
    majority_vote,
    model_thinks,
    normalize_answer,
    same_answer,
    split_reasoning,
)


def stream(chunks: list[str], starts_in_reasoning: bool = False) -> tuple[ThinkSplitter, list]:
    splitter = ThinkSplitter(starts_in_reasoning)
    pieces = []
    for chunk in chunks:
        pieces += splitter.feed(chunk)
    pieces += splitter.finish()
    return splitter, pieces


def test_tags_split_across_tokens():
    splitter, pieces = stream(["<th", "ink>Let me ", "think.</", "thi", "nk>\n\nThe answer is 4."])
    assert splitter.reasoning == "Let me think."
    assert splitter.answer == "The answer is 4."
    assert [kind for kind, _ in itertools.groupby(k for k, _ in pieces)] == ["reasoning", "answer"]
    assert splitter.opened and splitter.closed and not splitter.unfinished


def test_every_split_point_gives_the_same_result():
    text = "<think>a < b and c</d> so</think>\n\nx = \\boxed{1}"
    for cut in range(len(text) + 1):
        splitter, _ = stream([text[:cut], text[cut:]])
        assert (splitter.reasoning, splitter.answer) == ("a < b and c</d> so", "x = \\boxed{1}")


def test_missing_opening_tag_on_a_thinking_model():
    splitter, _ = stream(
        ["First, 12*13", " = 156.", "</think>", "**156**"], starts_in_reasoning=True
    )
    assert splitter.reasoning == "First, 12*13 = 156."
    assert splitter.answer == "**156**"
    assert not splitter.opened


def test_missing_opening_tag_on_an_unknown_model_is_retracted_when_it_closes():
    splitter, pieces = stream(["Hmm, 2+2", " is 4</think>", "4"])
    assert splitter.retracted
    assert (splitter.reasoning, splitter.answer) == ("Hmm, 2+2 is 4", "4")
    # What was streamed before the model closed its thinking, then the retraction.
    assert pieces == [
        ("answer", "Hmm, 2+2"),
        ("retract", ""),
        ("reasoning", " is 4"),
        ("answer", "4"),
    ]


def test_no_tags_at_all_is_all_answer():
    splitter, pieces = stream(["The answer", " is 4."])
    assert splitter.reasoning == ""
    assert splitter.answer == "The answer is 4."
    assert pieces == [("answer", "The answer"), ("answer", " is 4.")]


def test_unclosed_thinking_at_max_tokens():
    splitter, _ = stream(["<think>", "Still working on it, ", "almost </thi"])
    assert splitter.unfinished
    assert splitter.answer == ""
    assert splitter.reasoning == "Still working on it, almost </thi"


def test_leading_whitespace_before_think_and_lone_angle_bracket():
    assert split_reasoning("  \n<think>x</think>y") == ("x", "y")
    assert split_reasoning("<b>bold</b>") == ("", "<b>bold</b>")
    assert split_reasoning("<") == ("", "<")


@pytest.mark.parametrize(
    ("solution", "answer"),
    [
        ("So \\boxed{156}.", "156"),
        ("\\boxed{\\frac{1}{2}} then \\boxed{\\dfrac{3}{4}}", "\\dfrac{3}{4}"),
        ("x = \\boxed{\\{1, \\{2\\}\\}}", "\\{1, \\{2\\}\\}"),
        ("\\boxed{x^{2} + \\sqrt{\\frac{a}{b}}}", "x^{2} + \\sqrt{\\frac{a}{b}}"),
        ("The answer is $\\boxed 5$.", "5"),
        ("Thus the final answer is 42.", "42"),
        ("The final answer is: $x = -\\frac{2}{3}$", "x = -\\frac{2}{3}"),
        ("final answer is **7**\nmore text", "7"),
        ("I think it's probably 12.", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_final_answer_extraction(solution: str, answer: str | None):
    assert extract_final_answer(solution) == answer


def test_boxed_answers_lists_all_in_order():
    assert boxed_answers("\\boxed{1}, \\fbox{2} and \\boxed {3}") == ["1", "2", "3"]


def test_normalize_answer():
    assert normalize_answer("$\\dfrac{1}{2}$") == normalize_answer("\\frac{1}{2}")
    assert normalize_answer("x = 5") == normalize_answer("5")
    assert normalize_answer("\\left(1, 2\\right)") == "(1,2)"
    assert normalize_answer("4.0") == "4"


def test_majority_vote_picks_most_common_and_reports_agreement():
    vote = majority_vote(["156", "\\boxed{156}", "156.0", None, "155"])
    assert vote.answer == "156"
    assert (vote.votes, vote.total, vote.agreement, vote.tie) == (3, 5, "3/5", False)
    assert vote.members == (0, 1, 2)


def test_equal_answers_count_together_however_they_are_written():
    # Before: \frac12 and \frac{1}{2} were different answers, so one third won 2-2 on a tie.
    vote = majority_vote(
        ["\\frac{1}{3}", "\\frac12", "\\frac{1}{3}", "\\dfrac{1}{2}", "\\frac{1}{2}"]
    )
    assert (vote.agreement, vote.tie) == ("3/5", False)
    assert vote.answer in ("\\frac12", "\\dfrac{1}{2}", "\\frac{1}{2}")
    assert majority_vote(["0.5", "x = \\frac{1}{2}", "\\frac{1}{2}", "2"]).agreement == "3/4"
    roots = majority_vote(["x = 2 \\text{ or } x = 3", "\\{3, 2\\}", "3"])
    assert roots.agreement == "2/3"
    # The most common written form is reported.
    assert majority_vote(["0.5", "\\frac{1}{2}", "\\frac{1}{2}"]).answer == "\\frac{1}{2}"
    # What math-verify cannot parse is compared as text.
    assert majority_vote(["a cat", "a  cat", "a dog"]).agreement == "2/3"
    assert same_answer("\\sqrt{2}/2", "\\frac{\\sqrt2}{2}")
    assert not same_answer("3", "4")


def test_majority_vote_tie_goes_to_the_earliest_answer():
    vote = majority_vote(["3", "4", "4", "3"])
    assert vote.answer == "3" and vote.tie and vote.agreement == "2/4"


def test_majority_vote_without_answers():
    vote = majority_vote([None, None])
    assert vote.answer is None and vote.agreement == "0/2"


def test_model_thinks_by_name():
    assert model_thinks("Phi 4 Mini Reasoning")
    assert model_thinks("", "microsoft_Phi-4-mini-reasoning-Q4_K_M.gguf")
    assert not model_thinks("SmolLM2 135M Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.parametrize(
    ("latex", "text"),
    [
        ("\\frac{1}{2}", "1/2"),
        ("\\dfrac{a+1}{b}", "(a+1)/b"),
        ("x^2", "x²"),
        ("x^{10}", "x¹⁰"),
        ("a_1", "a₁"),
        ("\\sqrt{3}", "√3"),
        ("\\sqrt{b^2-4ac}", "√(b²-4ac)"),
        ("\\sqrt[3]{8}", "∛8"),
        ("3 \\times 4 \\leq \\infty", "3 \u00d7 4 ≤ ∞"),
        ("\\boxed{156}", "156"),
    ],
)
def test_math_to_unicode(latex: str, text: str):
    assert math_to_unicode(latex) == text


def test_latex_in_markdown_only_math_is_converted():
    source = (
        "**Step 1:** solve $3x^2+4x+5=1$, 50% done.\n\\[ x = \\frac{-4 \\pm \\sqrt{-32}}{6} \\]"
    )
    assert latex_to_unicode(source) == (
        "**Step 1:** solve 3x²+4x+5=1, 50% done.\n\nx = (-4 ± √(-32))/6\n\n"
    )
    assert latex_to_unicode("so \\boxed{\\dfrac{1}{2}} of it") == "so 1/2 of it"


NOTATION = Path(__file__).parent / "data" / "notation.tsv"


def _notation_cases() -> list[tuple[str, str]]:
    rows = NOTATION.read_text(encoding="utf-8").splitlines()[1:]
    return [tuple(row.split("\t")) for row in rows if row]  # type: ignore[misc]


@pytest.mark.parametrize(("latex", "shown"), _notation_cases())
def test_notation_corpus_reads_cleanly(latex: str, shown: str):
    # Before: 30^\circ was 30^∘; a sum's bounds ran together (∑_n=1^∞1/(n^s)); a complex root
    # -2/3±(√2)/3i read as √2/(3i); f''(x) was f”(x); \det and \triangle vanished.
    text = math_to_unicode(latex)
    assert text == shown
    assert "\\" not in text, "no LaTeX command is left over"
    assert not re.search(r"\^[^(\s]{2}", text), "no ^ runs into a multi-character exponent"


def test_the_renderer_never_fails_on_what_models_write():
    # Before: a newline after ^ or _ raised AssertionError after the answer had streamed.
    assert latex_to_unicode("$$x^\n2$$").strip() == "x²"
    assert latex_to_unicode("$$\\sum_\n{n}$$").strip() == "∑(n)"
    # \left\{ ... \right\} kept its braces (they were taken for a group).
    assert math_to_unicode(r"\left\{ 1, 2 \right\}") == "{1, 2}"
    assert math_to_unicode(r"x \in \left\{a,b\right\}") == "x ∈ {a,b}"
    assert math_to_unicode("\\frac{1}{") == "1/()", "an unclosed group, read as empty"
