"""Comparing values for :mod:`phi4cli.text.checking`: two numbers (:func:`compare`), two
expressions at random points to 50 digits (:func:`equivalent`), each ``"same"``, ``"apart"`` or
None (undecided); a computed exact value against an answer, where a decimal answer may be it
rounded (:func:`against`); and a value as a detail line shows it (:func:`shown`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from phi4cli.text.check_reading import answer_values
from phi4cli.text.check_verdicts import REFUTED, VERIFIED, Check, unchecked

if TYPE_CHECKING:
    from collections.abc import Iterator

# --- comparing values ------------------------------------------------------------------------

DIGITS = 50  # precision of numerical comparisons
ROUNDS = 12  # random points an equivalence is judged at (those where both sides are real)
SAME = 1e-40  # relative difference under which two values are one
APART = 1e-10  # relative difference over which they are two


def to_number(value: Any) -> Any:
    """``value`` evaluated to DIGITS digits: an mpmath-backed SymPy number, or None when it is
    not a finite number (a symbol left, infinity, nan)."""
    import sympy

    try:
        number = sympy.N(value, DIGITS)
    except (TypeError, ValueError, ZeroDivisionError, ArithmeticError):
        return None
    if not isinstance(number, sympy.Expr) or number.free_symbols:
        return None
    if number.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo):
        return None
    if not number.is_number:
        return None
    return number


def compare(a: Any, b: Any) -> str | None:
    """ "same", "apart" or None (undecided) for two numbers."""
    import sympy

    if isinstance(a, sympy.Rational) and isinstance(b, sympy.Rational):
        return "same" if a == b else "apart"  # exact
    x, y = to_number(a), to_number(b)
    if x is None or y is None:
        return None
    try:
        difference = abs(complex(x - y))
        scale = max(1.0, abs(complex(x)), abs(complex(y)))
    except (TypeError, ValueError, OverflowError):
        return None
    if difference <= SAME * scale:
        # Exact numbers equal to 50 digits may still differ further out: ask SymPy when cheap.
        if (a - b).is_zero is False and not (a.has(sympy.Float) or b.has(sympy.Float)):
            return None
        return "same"
    if difference > APART * scale:
        return "apart"
    return None


def _points(count: int) -> Iterator[Any]:
    """Fixed pseudo-random rational points in (0.2, 2.8) or (2, 28), of either sign, away from
    simple singularities: of both signs and sizes, so that |x + 3| and x + 3 differ somewhere."""
    import random

    import sympy

    rng = random.Random(20261207)
    for _ in range(count):
        point = sympy.Rational(rng.randint(200_000, 2_800_000), 1_000_000) * rng.choice((1, 10))
        yield rng.choice((1, -1)) * point + sympy.Rational(1, 7919)


def equivalent(a: Any, b: Any, variables: list[Any]) -> str | None:
    """ "same", "apart" or None for two expressions in ``variables``: compared at random points
    to DIGITS digits (at least 4 points where both are finite and real, else undecided)."""
    import sympy

    if not variables:
        return compare(a, b)
    try:
        difference = sympy.expand(a - b)
    except (TypeError, ValueError, ArithmeticError, RecursionError):
        difference = None
    if difference == 0:
        return "same"
    if difference is not None and not difference.free_symbols:
        return compare(difference, sympy.Integer(0))  # x + 10^-60 and x: apart, exactly
    # With a root, a logarithm or an absolute value, equal where both are real is not equal
    # (sqrt(x^2 + 6x + 9) and x + 3; ln(x^2) and 2 ln x): only a proof says "same".
    branched = any(
        isinstance(node, (sympy.log, sympy.Abs))
        or (isinstance(node, sympy.Pow) and not node.exp.is_Integer)
        for side in (a, b)
        for node in sympy.preorder_traversal(side)
    )
    verdicts: list[str] = []
    points = list(_points(ROUNDS * len(variables)))
    for round_ in range(ROUNDS):
        at = {v: points[round_ * len(variables) + k] for k, v in enumerate(variables)}
        try:
            x = to_number(a.subs(at))
            y = to_number(b.subs(at))
        except (TypeError, ValueError, ArithmeticError, RecursionError):
            continue
        real = [v is not None and v.is_real for v in (x, y)]
        if not any(real):
            continue
        if not all(real):
            return None  # defined at this point on one side only: another domain
        verdict = compare(x, y)
        if verdict is None:
            return None
        verdicts.append(verdict)
    if len(verdicts) < 4:
        return None
    # Equal at some points and not at others (|x| and x): it depends on the domain, undecided.
    if all(v == "same" for v in verdicts):
        if branched:
            try:
                return "same" if sympy.simplify(a - b) == 0 else None
            except (TypeError, ValueError, ArithmeticError, RecursionError):
                return None
        return "same"
    if all(v == "apart" for v in verdicts):
        return "apart"
    return None


def shown_short(value: Any) -> str:
    """A number as the detail shows it: exact where it is rational, else to 8 digits."""
    import sympy

    simpler = sympy.nsimplify(value) if value.is_number and not value.has(sympy.Float) else value
    if isinstance(simpler, sympy.Rational):
        return shown(simpler)
    number = to_number(value)
    return shown(value) if number is None else shown(sympy.N(number, 8))


def shown(value: Any) -> str:
    """A SymPy value as the detail line shows it: ``156``, ``-1/3``, ``sqrt(2)``, ``x^2 + 1``."""
    import sympy

    text = sympy.sstr(value, order="grlex") if isinstance(value, sympy.Basic) else str(value)
    return text.replace("**", "^").replace("*", "·").replace("I", "i")


def against(value: Any, answer: str, what: str) -> Check:
    """A computed exact ``value`` (``what``, as the detail names it) against the answer."""
    given = answer_values(answer, None)
    if given is None or len(given) != 1:
        return unchecked("the answer is not one number")
    verdict = compare(given[0], value)
    if verdict == "same":
        return Check(VERIFIED, f"{what} = {shown(value)}")
    if verdict == "apart":
        if _rounded(answer, given[0], value):
            return unchecked(f"{what} = {shown_short(value)}: the answer may be it rounded")
        return Check(REFUTED, f"{what} = {shown_short(value)}, not {shown_short(given[0])}")
    return unchecked(f"could not compare the answer with {what} = {shown(value)}")


def _rounded(answer: str, given: Any, value: Any) -> bool:
    """Whether an answer written with a decimal point may be ``value`` rounded (``0.333`` for
    1/3, ``1.2158 \\times 10^{19}`` for 3^40): within half a unit of its last place, or 1%:
    not a wrong value, so no refutation."""
    if not has_decimal(answer):
        return False
    places = max(len(d) for d in re.findall(r"\.(\d+)", answer))
    x, y = to_number(given), to_number(value)
    if x is None or y is None:
        return True  # (undecided: say nothing against it)
    try:
        gap = abs(complex(x - y))
        return gap <= 0.5001 * 10.0**-places or gap <= 0.01 * abs(complex(y))
    except (TypeError, ValueError, OverflowError):
        return True


def has_decimal(answer: str) -> bool:
    return re.search(r"\d?\.\d", answer) is not None
