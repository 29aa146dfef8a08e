"""Checked answers (phi4cli.text.checking, phi4cli.text.checker): each kind of problem decided
right, what cannot be decided left unchecked — never a wrong verdict, on hand-written cases, on
random problems with known answers, and on the public MATH-500 and GSM8K rows with their
reference answers (right) and perturbed ones (wrong); a check bounded in time by its worker; and
the verdict shown by every door: solve (JSON, pipe, --answer-only, strict), a file of problems,
samples, eval, chat and serve, through the daemon and a remote engine."""

from __future__ import annotations

import json
import random
import re
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phi4cli.text.check_verdicts import REFUTED, UNCHECKED, VERIFIED
from phi4cli.text.checker import Checker
from phi4cli.text.checking import check, checkable
from tests.conftest import run_phi4
from tests.scripted_server import scripted_server, separated

DATA = Path(__file__).resolve().parent.parent / "bench" / "data"

CASES = [
    # arithmetic and number theory
    ("What is 12*13?", "156", VERIFIED),
    ("What is 12*13?", "146", REFUTED),
    ("What is 12 \u00d7 13?", "156", VERIFIED),
    (r"Compute $\dbinom{31}{28}$.", "4495", VERIFIED),
    (r"Compute $\dbinom{31}{28}$.", "4496", REFUTED),
    ("What is gcd(48, 18)?", "6", VERIFIED),
    ("What is the least common multiple of 4 and 6?", "12", VERIFIED),
    ("What is the remainder when 2^100 is divided by 7?", "2", VERIFIED),
    ("What is the remainder when 2^100 is divided by 7?", "3", REFUTED),
    ("What is 7! mod 11?", "2", VERIFIED),
    (r"Compute $\sum_{k=1}^{10} k^2$.", "385", VERIFIED),
    (r"Simplify $\sqrt{242}$.", r"11\sqrt2", VERIFIED),
    ("Evaluate $(1+2i)6-3i$.", "6+9i", VERIFIED),
    ("What is 1/3 + 1/6?", r"\frac{1}{2}", VERIFIED),
    ("What is 1/3 + 1/6?", "0.5", VERIFIED),
    ("What is 2/3?", "0.667", UNCHECKED),  # rounded: not a wrong value
    ("What is 6/2(1+2)?", "9", UNCHECKED),  # reads two ways
    ("What is 2^10^10?", "1", UNCHECKED),  # a tower: not computed
    ("What is 10% of 50?", "5", UNCHECKED),
    ("What is 3 + 4 in base 2?", "111", UNCHECKED),
    (r"What is $1\frac{1}{2} + 1$?", "2.5", UNCHECKED),  # a mixed number reads two ways
    ("What is 9/5?", r"1\frac{4}{5}", UNCHECKED),  # in an answer too
    ("What is -3^2?", "9", UNCHECKED),  # -9 by convention; not everyone's
    ("What is 8/4/2?", "1", UNCHECKED),
    ("Simplify sqrt(x^2)", "x", UNCHECKED),  # |x|: equal for x > 0 only
    # equations and systems
    ("Solve x^2 - 5x + 6 = 0", r"x = 2 \text{ or } x = 3", VERIFIED),
    ("Solve $x^2-5x+6=0$", r"\{2,3\}", VERIFIED),
    ("Solve x^2 - 5x + 6 = 0", "x = 2", REFUTED),  # a missing root
    ("Solve x^2 - 5x + 6 = 0", "2, 3, 4", REFUTED),  # an extra one
    ("Solve 3x^2+4x+5=1", "x = -1", REFUTED),  # (its roots are not real)
    ("Solve x^2 = 4", r"x = \pm 2", VERIFIED),
    ("Find the roots of $(x - 3)^3 + (x -7)^3 = (2x - 10)^3.$", "3, 5, 7", VERIFIED),
    ("Find all real x such that x^3 = 8", "2", VERIFIED),
    ("Solve the system x + y = 10, x - y = 2", "(x, y) = (6, 4)", VERIFIED),
    ("Solve the system x + y = 10, x - y = 2", "x = 6, y = 5", REFUTED),
    ("Solve the system x + y = 10 and x - y = 2", "(6, 4)", VERIFIED),
    ("Solve (x^2-1)/(x-1) = 2", "x = 1", REFUTED),  # outside the domain
    ("Solve for the positive value of x such that x^2 = 4", "2", UNCHECKED),
    ("Solve 2^x = 8", "3", UNCHECKED),  # satisfies; others not looked for
    ("Solve 2^x = 8", "4", REFUTED),
    # inequalities
    ("Solve x^2 - 5x + 6 < 0", "(2, 3)", VERIFIED),
    ("Solve x^2 - 5x + 6 < 0", "2 < x < 3", VERIFIED),
    ("Solve x^2 - 5x + 6 < 0", "[2, 3]", REFUTED),
    ("Solve x^2 - 5x + 6 > 0", r"(-\infty, 2) \cup (3, \infty)", VERIFIED),
    ("Solve x^2 - 5x + 6 > 0", "x < 2 or x > 3", VERIFIED),
    ("Solve x^2 - 5x + 6 > 0", "x > 3", REFUTED),
    # calculus
    ("Find the derivative of x^3 sin(x)", r"3x^2\sin x + x^3 \cos x", VERIFIED),
    ("Find the derivative of x^3 sin(x)", r"3x^2\sin x", REFUTED),
    ("Differentiate e^{2x}", "2e^{2x}", VERIFIED),
    (r"Find $\int x e^x \, dx$", r"e^x(x-1) + C", VERIFIED),
    (r"Find $\int x e^x \, dx$", "xe^x + C", REFUTED),
    ("Integrate 1/x", r"\ln|x| + C", UNCHECKED),  # |x| is not read
    ("Integrate 1/x", r"\ln x + C", VERIFIED),
    (r"Evaluate $\int_0^1 x^2 \, dx$", r"\frac13", VERIFIED),
    (r"Evaluate $\int_0^1 x^2 \, dx$", r"\frac12", REFUTED),
    (r"Evaluate $\int_0^{\pi} \sin x \, dx$", "2", VERIFIED),
    (r"Compute $\lim_{x \to 0} \frac{\sin x}{x}$", "1", VERIFIED),
    (r"Compute $\lim_{x \to 0} \frac{\sin x}{x}$", "0", REFUTED),
    (r"Find $\lim_{x \to \infty} (1 + 1/x)^x$", "e", VERIFIED),
    (r"Find $\sum_{n=1}^{\infty} \frac{1}{n^2}$", r"\frac{\pi^2}{6}", VERIFIED),
    (r"Find $\sum_{n=1}^{\infty} \frac{1}{n^2}$", r"\frac{\pi^2}{3}", REFUTED),
    # simplify, expand, factor
    ("Simplify (x^2-1)/(x-1)", "x+1", VERIFIED),
    ("Simplify (x^2-1)/(x-1)", "x-1", REFUTED),
    ("Factor x^2-5x+6", "(x-2)(x-3)", VERIFIED),
    ("Factor x^2-5x+6", "(x-2)(x+3)", REFUTED),
    ("Factor x^4-1", "(x^2-1)(x^2+1)", UNCHECKED),  # equal, not factored completely
    ("Expand (x+1)^2", "x^2+2x+1", VERIFIED),
    ("Expand (x+1)^2", "(x+1)^2", UNCHECKED),  # equal, not expanded
    ("Expand (x+1)^2", "x^2+x+1", REFUTED),
    # found by a hostile review: each once a wrong verdict
    ("Compute 5!", "120", VERIFIED),
    ("Compute 5!!", "15", UNCHECKED),
    ("What is log(100)?", "2", UNCHECKED),
    ("Solve log(x) + log(x-3) = 1", "x = 5", UNCHECKED),
    (r"What is \sqrt[3]{-8}?", "-2", UNCHECKED),
    ("Solve x^{2/3} = 4", "x = 8 or x = -8", UNCHECKED),
    ("Solve sin(x) > 0", r"(0, \pi)", UNCHECKED),
    ("Solve x/4 = 250", "x = 1,000", UNCHECKED),
    ("What is 999+1?", r"1\,000", UNCHECKED),
    ("What is 1 1/2 + 2 1/2?", "4", UNCHECKED),
    ("What is 1\u00bd + 1\u00bd?", "3", UNCHECKED),
    ("What is 1 - 1/3?", "0.666...", UNCHECKED),
    ("Compute 0.999...", "1", UNCHECKED),
    ("Solve x^2 = 2", r"x = \pm 1.414", UNCHECKED),
    ("What is 3^{40}?", r"1.2158 \times 10^{19}", UNCHECKED),
    ("What is 0.1+0.2?", "0.4", REFUTED),
    ("What is 300*400?", "1.2e5", UNCHECKED),
    ("Simplify 2a + 3b - a + c", "a + 3b + c", VERIFIED),
    ("Find the derivative of x^2", "2x + C", UNCHECKED),
    ("What is \u221a3 \u00d7 \u221a3?", "3", VERIFIED),
    ("Simplify x^2y/xy", "x", UNCHECKED),
    (r"What is \sin \pi/6?", "1/2", UNCHECKED),
    ("What is 3 + 5 mod 3?", "5", UNCHECKED),
    (r"What is \sum_{k=1}^{10} k + 1?", "56", UNCHECKED),
    ("Differentiate e^2x", "2e^{2x}", UNCHECKED),
    (r"What is \cos 60?", "1/2", UNCHECKED),
    (r"Solve x^2 + \frac{1}{x-2} = 4 + \frac{1}{x-2}", "x = -2", VERIFIED),
    (r"Solve \frac{(x-3)^2}{x-3} = 0", "x = 3", REFUTED),
    (r"Solve \frac{x^2}{x} \ge 0", r"(0,\infty)", VERIFIED),
    (r"Simplify \sqrt{x^2 + 6x + 9}", "x + 3", UNCHECKED),
    (r"Simplify \ln(x^2)", r"2\ln x", UNCHECKED),
    ("Simplify x + 10^{-60}", "x", REFUTED),
    ("Solve the system x+y+z+w = 10, x-y = -1, z-w = -1, x+z = 4", "(1, 2, 3, 4)", UNCHECKED),
    ("What is the remainder when 100 is divided by -7?", "2", UNCHECKED),
    ("Factor 2x^2-10x+12", "(2x-4)(x-3)", UNCHECKED),
    ("Factor 2x^2-10x+12", "2(x-2)(x-3)", VERIFIED),
    ("Expand 2(x+1)", "2(x+1)", UNCHECKED),
    (r"Solve 2\cos x = 1, 0 \le x \le \pi", r"\pi/3", UNCHECKED),
    # words, and answers that are not values
    ("How many positive divisors does 196 have?", "9", UNCHECKED),
    ("What is 12*13?", r"\text{one hundred fifty-six}", UNCHECKED),
    ("Solve x^2 - 5x + 6 = 0", "two and three", UNCHECKED),
]


@pytest.mark.parametrize(
    ("problem", "answer", "verdict"), CASES, ids=[f"{p[:30]}->{a[:15]}" for p, a, _ in CASES]
)
def test_each_kind_of_problem_gets_its_verdict_and_a_line_saying_how(
    problem: str, answer: str, verdict: str
):
    found = check(problem, answer)
    assert found.verdict == verdict, found
    assert found.detail and "\n" not in found.detail


def test_the_details_say_how_in_the_problems_terms():
    assert check("What is 12*13?", "146").detail == "12·13 = 156, not 146"
    assert check("Solve x^2 - 5x + 6 = 0", "x = 2").detail.endswith("also has the root x = 3")
    assert check(r"Find $\int x e^x \, dx$", "e^x(x-1) + C").detail == (
        "d/dx of the answer is the integrand"
    )
    assert check("Solve x^2 - 5x + 6 < 0", "[2, 3]").detail == (
        "the solution set is (2, 3), not [2, 3]"
    )


def _arithmetic(draw: Any) -> tuple[str, Fraction]:
    """An expression in whole numbers with + - * / and small powers, and its exact value."""
    depth = draw(st.integers(1, 3))

    def build(level: int) -> tuple[str, Fraction]:
        if level == 0:
            n = draw(st.integers(0, 40))
            return str(n), Fraction(n)
        (a, x), (b, y) = build(level - 1), build(level - 1)
        op = draw(st.sampled_from("+-*/^"))
        if op == "/" and y == 0:
            op = "+"
        if op == "^":
            power = draw(st.integers(0, 3))
            return f"({a})^{power}", x**power
        value = {"+": x + y, "-": x - y, "*": x * y, "/": x / y if y else x}[op]
        return f"({a}) {op} ({b})", value

    return build(depth)


@st.composite
def arithmetic(draw: Any) -> tuple[str, Fraction]:
    return _arithmetic(draw)


def _written(value: Fraction, style: int) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    if style == 0:
        return f"{value.numerator}/{value.denominator}"
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


@settings(max_examples=150, deadline=None)
@given(arithmetic(), st.integers(0, 1), st.sampled_from(["What is", "Compute", "Evaluate"]))
def test_random_arithmetic_is_verified_and_a_value_off_by_one_refuted(
    expression: tuple[str, Fraction], style: int, lead: str
):
    text, value = expression
    problem = f"{lead} {text}?"
    right = check(problem, _written(value, style))
    wrong = check(problem, _written(value + 1, style))
    assert right.verdict != REFUTED, (problem, right)
    assert wrong.verdict != VERIFIED, (problem, wrong)
    if right.verdict == VERIFIED:
        assert wrong.verdict == REFUTED, (problem, wrong)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-9, 9), min_size=1, max_size=3, unique=True), st.integers(0, 2))
def test_random_polynomials_roots_all_verified_and_one_missing_refuted(roots: list[int], form: int):
    import sympy

    x = sympy.Symbol("x")
    poly = sympy.expand(sympy.prod([x - r for r in roots]))
    problem = f"Solve {str(poly).replace('**', '^')} = 0"
    given_ = [f"x = {r}" for r in roots]
    answer = {
        0: " \\text{ or } ".join(given_),
        1: ", ".join(map(str, roots)),
        2: "\\{" + ", ".join(map(str, roots)) + "\\}",
    }[form]
    assert check(problem, answer).verdict == VERIFIED, (problem, answer)
    if len(roots) > 1:
        assert check(problem, ", ".join(map(str, roots[1:]))).verdict == REFUTED
    extra = max(roots) + 1
    assert check(problem, ", ".join(map(str, [*roots, extra]))).verdict == REFUTED


def perturbed(answer: str) -> str | None:
    """The answer with its first whole number one larger: a wrong answer (or None)."""
    match = re.search(r"\d+", answer)
    if match is None:
        return None
    return answer[: match.start()] + str(int(match.group()) + 1) + answer[match.end() :]


@pytest.mark.parametrize("name", ["math500", "gsm8k"])
def test_the_public_problems_reference_answers_are_never_refuted_nor_wrong_ones_verified(
    name: str,
):
    # MATH-500 and GSM8K (bench/data, public rows with their licences): a reference answer is
    # right, so refuting it is a wrong verdict; a perturbed one is wrong, so verifying it is.
    wrong_verdicts = []
    decided = 0
    for line in (DATA / f"{name}.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        right = check(row["problem"], row["answer"])
        decided += right.verdict == VERIFIED
        if right.verdict == REFUTED:
            wrong_verdicts.append((row["index"], row["answer"], right.detail))
        wrong = perturbed(row["answer"])
        if wrong is not None and check(row["problem"], wrong).verdict == VERIFIED:
            wrong_verdicts.append((row["index"], wrong, "verified"))
    assert not wrong_verdicts
    if name == "math500":
        assert decided >= 15  # (the few problems written as plain mathematics are decided)


def test_a_problem_of_no_known_kind_starts_no_worker_and_is_unchecked_at_once():
    checker = Checker()
    checker.prepare("How many apples are left?")
    assert checker._worker is None
    assert checker.check("How many apples are left?", "3").verdict == UNCHECKED
    assert checker._worker is None
    assert not checkable("How many apples are left?")
    assert checkable("What is 12*13?")


def test_the_worker_checks_and_a_check_past_its_time_is_unchecked_and_the_next_one_works():
    with Checker(seconds=1.0) as checker:
        checker.prepare("What is 12*13?")
        assert checker.check("What is 12*13?", "146").verdict == REFUTED
        worker = checker._worker
        assert worker is not None
        started = time.monotonic()
        slow = checker.check("What is factorial(3000000)?", "3")  # computed in full: seconds
        assert time.monotonic() - started < 3
        assert slow == ("unchecked", "the check took longer than 1 s")
        assert worker.poll() is not None  # killed
        assert checker.check("What is 12*13?", "156").verdict == VERIFIED
        assert checker.timed_out == 1
        last = checker._worker
    assert last is not None and last.wait(timeout=5) is not None


# --- every door ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wrong_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tinymodel import write_text_script_model

    path = tmp_path_factory.mktemp("check") / "wrong.gguf"
    return write_text_script_model(path, "Twelve times thirteen. ", " So $\\boxed{146}$.")


@pytest.fixture(scope="module")
def right_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tinymodel import write_text_script_model

    path = tmp_path_factory.mktemp("check") / "right.gguf"
    return write_text_script_model(path, "Twelve times thirteen. ", " So $\\boxed{156}$.")


QUESTION = "What is 12*13?"


@pytest.mark.daemon
def test_solve_shows_the_verdict_in_every_mode_and_strict_exits_1(
    wrong_model: Path, right_model: Path
):
    base = ["solve", QUESTION, "-m", str(wrong_model), "-t", "0"]
    record = json.loads(run_phi4(*base, "--json").stdout)
    assert record["answer"] == "146"
    assert record["check"] == {"verdict": "refuted", "detail": "12·13 = 156, not 146"}
    # A pipe (run by the daemon itself once it is up) and --answer-only: a line on stderr.
    for extra in ([], ["-a"], []):
        done = run_phi4(*base, *extra)
        assert done.returncode == 0, done.stderr
        assert "phi4: \u2717 refuted: 12·13 = 156, not 146" in done.stderr
    strict = run_phi4(*base, "--check", "strict", "-a")
    assert strict.returncode == 1 and strict.stdout == "146\n"
    off = json.loads(run_phi4(*base, "--json", "--check", "off").stdout)
    assert "check" not in off
    assert (
        json.loads(run_phi4(*base, "--json", env={"PHI4_CHECK": "off"}).stdout).get("check") is None
    )
    right = run_phi4("solve", QUESTION, "-m", str(right_model), "-t", "0", "--check", "strict")
    assert right.returncode == 0
    assert "\u2713 verified: 12·13 = 156" in right.stderr


@pytest.mark.daemon
def test_a_file_of_problems_carries_each_verdict(wrong_model: Path, tmp_path: Path):
    problems = tmp_path / "p.txt"
    problems.write_text(f"{QUESTION}\nHow many apples?\n")
    done = run_phi4("solve", "--file", str(problems), "--jsonl", "-m", str(wrong_model), "-t", "0")
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["check"]["verdict"] for r in records] == ["refuted", "unchecked"]
    assert "line 1: \u2717 refuted: 12·13 = 156, not 146" in done.stderr
    assert "1 of 2 answers failed their check" in done.stderr
    plain = run_phi4(
        "solve", "--file", str(problems), "-m", str(wrong_model), "-t", "0", "--check", "strict"
    )
    assert "Answer: 146  (\u2717 refuted: 12·13 = 156, not 146)" in plain.stdout
    assert plain.returncode == 1


def _answers(*answers: str) -> Any:
    """A scripted server whose n-th request is answered with the n-th answer (round robin)."""
    count = iter(range(10**6))

    def script(_body: dict[str, Any]) -> list[Any]:
        answer = answers[next(count) % len(answers)]
        return separated("reasoning_content", ["Think."], [f"So $\\boxed{{{answer}}}$."])

    return script


@pytest.mark.daemon
def test_a_remote_engine_s_answer_is_checked_and_a_verified_one_wins_the_vote():
    with scripted_server(_answers("146")) as server:
        record = json.loads(
            run_phi4("solve", QUESTION, "--backend", server.url, "-m", "m", "--json").stdout
        )
    assert record["check"]["verdict"] == "refuted"
    # Three samples say 146 and one 156: the verified answer wins over the refuted majority.
    with scripted_server(_answers("146", "146", "156", "146")) as server:
        record = json.loads(
            run_phi4(
                "solve", QUESTION, "--backend", server.url, "-m", "m", "-k", "4", "--all", "--json"
            ).stdout
        )
    assert record["answer"] == "156"
    assert record["check"]["verdict"] == "verified"
    assert sorted(s["check"]["verdict"] for s in record["samples"]) == [
        "refuted",
        "refuted",
        "refuted",
        "verified",
    ]


@pytest.mark.daemon
def test_a_verified_sample_settles_the_vote_early():
    with scripted_server(_answers("156")) as server:
        done = run_phi4(
            "solve",
            QUESTION,
            "--backend",
            server.url,
            "-m",
            "m",
            "-k",
            "8",
            "--backend-concurrency",
            "1",
            "--json",
        )
    record = json.loads(done.stdout)
    assert record["answer"] == "156" and record["samples_used"] < 8
    assert "verified" in done.stderr or record["check"]["verdict"] == "verified"


@pytest.mark.daemon
def test_eval_records_the_verdicts_and_counts_those_the_references_contradict(tmp_path: Path):
    problems = tmp_path / "p.jsonl"
    problems.write_text(
        json.dumps({"problem": QUESTION, "answer": "156"})
        + "\n"
        + json.dumps({"problem": "What is 2+3?", "answer": "5"})
        + "\n"
    )
    results = tmp_path / "out.jsonl"
    with scripted_server(_answers("146", "5")) as server:
        done = run_phi4(
            "eval",
            str(problems),
            "--backend",
            server.url,
            "-m",
            "m",
            "-o",
            str(results),
            "--json",
            "--backend-concurrency",
            "1",
        )
    summary = json.loads(done.stdout)
    assert summary["checks"] == {"verified": 1, "refuted": 1, "unchecked": 0, "wrong_verdicts": 0}
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["check"]["verdict"] for r in records] == ["refuted", "verified"]


@pytest.mark.daemon
def test_a_piped_chat_says_each_verdict(wrong_model: Path):
    done = run_phi4(
        "chat", "-m", str(wrong_model), "-t", "0", input=f"{QUESTION}\n/set check off\n{QUESTION}\n"
    )
    assert done.stderr.count("\u2717 refuted: 12·13 = 156, not 146") == 1, done.stderr
    strict = run_phi4(
        "chat", "-m", str(wrong_model), "-t", "0", "--check", "strict", input=f"{QUESTION}\n"
    )
    assert strict.returncode == 1


@pytest.mark.daemon
def test_serve_gives_each_choice_its_check_in_an_extension_field(wrong_model: Path):
    from tests.test_http_api import JSON, chat_body, fetch, serving

    asked = {
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 200,
    }
    with serving(wrong_model) as url:
        status, body = fetch(url + "/v1/chat/completions", chat_body(**asked), JSON)
        assert status == 200, body
        choice = json.loads(body)["choices"][0]
        assert choice["phi4_check"] == {"verdict": "refuted", "detail": "12·13 = 156, not 146"}
        status, body = fetch(url + "/v1/chat/completions", chat_body(**asked, stream=True), JSON)
        chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][-1]
        assert last["choices"][0]["phi4_check"]["verdict"] == "refuted"


def test_random_seeds_are_not_needed_the_points_are_fixed():
    # Equivalence is judged at fixed points: the same question gets the same verdict every time.
    first = check("Simplify (x^2-1)/(x-1)", "x+1")
    random.seed(1)
    assert check("Simplify (x^2-1)/(x-1)", "x+1") == first


@pytest.mark.daemon
def test_eval_samples_keep_each_answer_though_the_vote_sets_refuted_ones_aside(tmp_path: Path):
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"problem": QUESTION, "answer": "156"}) + "\n")
    results = tmp_path / "out.jsonl"
    with scripted_server(_answers("146", "156")) as server:
        done = run_phi4(
            "eval",
            str(problems),
            "--backend",
            server.url,
            "-m",
            "m",
            "-o",
            str(results),
            "-k",
            "2",
            "--all",
            "--backend-concurrency",
            "1",
        )
    assert done.returncode == 0, done.stderr
    record = json.loads(results.read_text().splitlines()[0])
    assert sorted(record["samples"]) == ["146", "156"]  # each sample's own answer
    assert (record["answer"], record["status"], record["pass_at_k"]) == ("156", "correct", True)
    assert sorted(d["check"] for d in record["sample_details"]) == ["refuted", "verified"]
