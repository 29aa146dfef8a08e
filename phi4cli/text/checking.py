"""Checked answers: a problem and its final answer in, a verdict out — ``verified``, ``refuted``
or ``unchecked`` — with one line saying how (``12·13 = 156, not 146``, ``both roots satisfy
3x^2 + 4x + 5 = 1``, ``d/dx of the answer is the integrand``).

A pure room: text in, a :class:`Check` out, nothing else read or written. It knows a few kinds
of problem, each recognised from the whole of the problem's text (a lead-in such as "Solve" or
"What is" and the mathematics after it, nothing else) and checked with SymPy and mpmath:

- arithmetic and number theory: an expression in numbers (``gcd``, ``mod``, ``!``, binomials,
  finite sums, roots, ``i``) evaluated exactly;
- equations and systems: every root given is substituted; a polynomial's roots are all found,
  so a missing or extra one is seen;
- inequalities in one unknown: the answer's intervals against the solution set;
- derivatives, antiderivatives (the answer differentiated back), definite integrals, limits and
  infinite series (a closed form, cross-checked numerically to high precision);
- simplify, expand and factor: the answer's equivalence with the expression.

Everything else is ``unchecked``: a problem in words, a form this room does not read, a value it
cannot decide. That is never a guess — a wrong ``verified`` or a wrong ``refuted`` is a defect,
so every rule below says ``unchecked`` where it is unsure. Expressions are compared exactly
where SymPy decides cheaply, else at random points to 50 digits (two analytic expressions equal
at random points to 40 digits are the same; ones apart by more than 1e-10 differ).

:func:`check` has no bound of its own: SymPy can take long, or much memory, on a pathological
input. :mod:`phi4cli.text.checker` runs it in a worker process with limits on both; this
module's ``main`` is that worker's loop. :func:`checkable` says, without importing SymPy,
whether a problem is of a kind this room knows (so a worker is started only for those).

This module is the room's front: :func:`check`, :func:`checkable` and the worker. The kinds are
in ``check_arithmetic``, ``check_equations``, ``check_calculus`` and ``check_algebra`` (each its
patterns and its checks); they read text with ``check_reading``, compare values with
``check_values``, and answer a ``Check`` of ``check_verdicts``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from phi4cli.text.check_algebra import ALGEBRA, algebra_kind
from phi4cli.text.check_arithmetic import (
    ARITHMETIC,
    GCD,
    REMAINDER,
    arithmetic_kind,
    gcd_kind,
    remainder_kind,
)
from phi4cli.text.check_calculus import (
    CALCULUS,
    DERIVATIVE,
    INTEGRAL_WORDS,
    LIMIT_WORDS,
    antiderivative_kind,
    calculus_kind,
    derivative_kind,
    limit_words_kind,
)
from phi4cli.text.check_equations import SOLVE, solve_kind
from phi4cli.text.check_reading import Unreadable
from phi4cli.text.check_values import has_decimal
from phi4cli.text.check_verdicts import REFUTED, Check, unchecked

if TYPE_CHECKING:
    from collections.abc import Callable


NOT_A_KIND = "not a kind of problem phi4 checks (see docs/checking.md)"
NO_ANSWER = "no answer to check"


# Sentences and phrases that ask for a form of the answer, not another value: taken off the end
# of a problem before it is read. (Not "in base 8", "to the nearest tenth", "in degrees": those
# change what the answer's digits mean, and leave the problem unread.)
_FORM = re.compile(
    r"(?:\s*(?:express|enter|give|write)\s+(?:your\s+answer|all\s+(?:the\s+)?solutions)\s*"
    r"(?:as\s+a\s+common\s+fraction|in\s+simplest\s+(?:radical\s+)?form|"
    r"(?:using|in)\s+interval\s+notation|,?\s*separated\s+by\s+commas)\s*\.?"
    r"|\s+(?:as\s+a\s+common\s+fraction|in\s+simplest\s+(?:radical\s+)?form|"
    r"in\s+interval\s+notation)(?=\s*[?.]?\s*$))+\s*$",
    re.I,
)


def _problem_text(problem: str) -> str:
    text = re.sub(r"\s+", " ", problem.strip())
    text = re.sub(r"\$\s*([a-z])\s*\$", r"\1", text)  # "values of $x$": the letter
    text = re.sub(
        r"^(simplify|solve|expand|factor|evaluate|compute)\s+the\s+following"
        r"(?:\s+(?:expression|equation|inequality))?(?:\s+(?:in|for)\s+[a-z])?\s*:?",
        r"\1 ",
        text,
        flags=re.I,
    )
    return _FORM.sub("", text).strip()


def checkable(problem: str) -> bool:
    """Whether ``problem`` reads as a kind this room checks (cheap: no SymPy). False means the
    check would be ``unchecked``; True, that it may decide."""
    text = _problem_text(problem)
    if len(text) > 600:
        return False
    return any(
        pattern.match(text)
        for pattern in (
            REMAINDER,
            GCD,
            SOLVE,
            DERIVATIVE,
            INTEGRAL_WORDS,
            ALGEBRA,
            LIMIT_WORDS,
            CALCULUS,
            ARITHMETIC,
        )
    )


def check(problem: str, answer: str | None) -> Check:
    """The verdict on ``answer`` as the final answer to ``problem``. Unbounded in time and
    memory (run it through ``engines.checker``); never raises for the text given."""
    if answer is None or not answer.strip():
        return unchecked(NO_ANSWER)
    text = _problem_text(problem)
    if len(text) > 600 or len(answer) > 400:
        return unchecked("too long to check")
    for kind in _KINDS:
        try:
            found = kind(text, answer)
        except Unreadable as why:
            return unchecked(f"could not read {why}")
        except (RecursionError, MemoryError):
            return unchecked("too large to check")
        except Exception as error:  # SymPy's failures are many: never a verdict
            return unchecked(f"SymPy could not decide ({type(error).__name__})")
        if found is not None:
            if found.verdict == REFUTED and has_decimal(answer) and kind not in _EXACT_KINDS:
                # A decimal answer to an equation, a derivative...: perhaps rounded.
                return unchecked(f"a decimal answer, which may be rounded ({found.detail})")
            return _bounded(found)
    return unchecked(NOT_A_KIND)


DETAIL_CHARS = 160  # of a detail line: a 5,000-digit number is not worth a screen


def _bounded(found: Check) -> Check:
    if len(found.detail) <= DETAIL_CHARS:
        return found
    return Check(found.verdict, found.detail[: DETAIL_CHARS - 1] + "\u2026")


# Kinds that weigh a decimal answer's rounding themselves (check_values.against).
_EXACT_KINDS: tuple[Callable[[str, str], Check | None], ...] = (
    remainder_kind,
    gcd_kind,
    arithmetic_kind,
)

# Each kind returns None when the problem is not of it (the next is tried), else a Check.
_KINDS: tuple[Callable[[str, str], Check | None], ...] = (
    remainder_kind,
    gcd_kind,
    solve_kind,
    derivative_kind,
    antiderivative_kind,
    limit_words_kind,
    algebra_kind,
    calculus_kind,
    arithmetic_kind,
)


# --- the worker ------------------------------------------------------------------------------

WORKER_MEMORY = 2 << 30  # bytes of address space
WORKER_CPU_S = 600  # seconds of CPU time in all


def main() -> None:
    """A worker's loop (``python -m phi4cli.text.checking``): read ``{"problem", "answer"}``
    lines on stdin, answer each with a line ``{"verdict", "detail"}``; the first line written,
    ``{"ready": true}``, says SymPy is loaded."""
    import json
    import os
    import resource
    import sys

    # Bounds of its own, besides the client's clock: memory (a MemoryError is "unchecked") and
    # CPU time (a worker its client left in a long computation ends by itself).
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    resource.setrlimit(resource.RLIMIT_CPU, (WORKER_CPU_S, WORKER_CPU_S))
    os.nice(19)  # below the model's decoding threads
    check("what is 1+1", "2")  # SymPy's parser and numbers loaded before any answer waits
    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            result = check(str(request["problem"]), request.get("answer"))
        except (ValueError, KeyError, TypeError):
            result = unchecked("a request the checker could not read")
        sys.stdout.write(json.dumps(result.to_json()) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
