"""Calculus, kinds of problem :mod:`phi4cli.text.checking` checks: derivatives,
antiderivatives (the answer differentiated back), definite integrals, limits and infinite
series (a closed form SymPy finds, trusted where a numerical value agrees with it to high
precision). Each kind's pattern, and the kind: None where a problem is not of it.
"""

from __future__ import annotations

import re
from typing import Any

from phi4cli.text.check_reading import answer_values, expression, function_answer, parse, plain
from phi4cli.text.check_values import against, compare, equivalent, shown, to_number
from phi4cli.text.check_verdicts import REFUTED, VERIFIED, Check, unchecked

DERIVATIVE = re.compile(
    r"^(?:(?:find|compute|what\s+is|calculate|determine|give)\s+the\s+derivative\s+of|"
    r"differentiate)\s*:?\s*(?:(?:f|g|y)\s*(?:\(x\))?\s*=\s*)?(?P<e>.+?)"
    r"(?:\s+with\s+respect\s+to\s+x)?\s*[?.]?$",
    re.I,
)
INTEGRAL_WORDS = re.compile(
    r"^(?:(?:find|compute|evaluate|calculate|what\s+is)\s+)?(?:the\s+)?"
    r"(?:(?:indefinite\s+)?integral|antiderivative)\s+of\s+(?P<e>.+?)"
    r"(?:\s+(?:with\s+respect\s+to|dx|d\s*x)\s*x?)?\s*[?.]?$|"
    r"^integrate\s*:?\s*(?P<e2>.+?)(?:\s+with\s+respect\s+to\s+x)?\s*[?.]?$",
    re.I,
)
CALCULUS = re.compile(
    r"^(?:(?:find|compute|evaluate|calculate|determine|what\s+is|integrate)\s*(?:the\s+value\s+of"
    r"|the\s+integral|the\s+limit|the\s+sum)?\s*:?\s*)?(?P<e>.*(?:\\int|\\lim|\\sum|\\frac\{d\}"
    r"\{dx\}|d/dx).*?)\s*[?.]?$",
    re.I | re.S,
)


LIMIT_WORDS = re.compile(
    r"^(?:find|compute|evaluate|what\s+is)\s+the\s+limit\s+of\s+(?P<e>.+?)\s+as\s+(?P<v>[a-z])\s+"
    r"(?:approaches|goes\s+to|tends\s+to)\s+(?P<a>.+?)\s*[?.]?$",
    re.I,
)


def derivative_kind(text: str, answer: str) -> Check | None:
    match = DERIVATIVE.match(text)
    if match is None:
        return None
    import sympy

    x = sympy.Symbol("x")
    f = expression(match["e"], frozenset("x"))
    if f.free_symbols - {x}:
        return unchecked("a function of more than x")
    given = function_answer(answer, r"(?:f'\s*\(x\)|y'|g'\s*\(x\)|dy/dx|d/dx\s*\(.*\))", {x})
    if given is None:
        return unchecked("the answer is not an expression in x")
    derivative = sympy.diff(f, x)
    verdict = equivalent(given, derivative, [x])
    if verdict == "same":
        return Check(VERIFIED, f"d/dx {shown(f)} = {shown(derivative)}")
    if verdict == "apart":
        return Check(REFUTED, f"d/dx {shown(f)} = {shown(derivative)}, not {shown(given)}")
    return unchecked("could not compare the answer with the derivative")


def antiderivative_kind(text: str, answer: str) -> Check | None:
    match = INTEGRAL_WORDS.match(text)
    body: str | None = None
    if match is not None:
        body = match["e"] or match["e2"]
    else:
        indefinite = re.fullmatch(
            r"(?:(?:find|compute|evaluate|calculate|what\s+is)\s+)?"
            r"(?:the\s+integral\s*:?\s*)?\$?\s*\\int\s*(?![_^])(?P<e>.+?)"
            r"\\?,?\s*d\s*x\s*\$?\s*[?.]?",
            text,
            re.I,
        )
        if indefinite is not None:
            body = indefinite["e"]
    if body is None:
        return None
    import sympy

    body = re.sub(r"(?:\\,|\s)*d\s*x\s*\$?$", "", body.strip().rstrip("$").strip())
    x = sympy.Symbol("x")
    f = expression(
        body.strip().lstrip("\\int").strip() if body.strip().startswith("\\int") else body,
        frozenset("x"),
    )
    if f.free_symbols - {x}:
        return unchecked("an integrand in more than x")
    given = function_answer(answer, r"(?:F\s*\(x\))", {x}, constant=True)
    if given is None:
        return unchecked("the answer is not an expression in x")
    verdict = equivalent(sympy.diff(given, x), f, [x])
    if verdict == "same":
        return Check(VERIFIED, "d/dx of the answer is the integrand")
    if verdict == "apart":
        return Check(
            REFUTED,
            f"d/dx of the answer is {shown(sympy.diff(given, x))}, not the integrand {shown(f)}",
        )
    return unchecked("could not compare the answer's derivative with the integrand")


def limit_words_kind(text: str, answer: str) -> Check | None:
    match = LIMIT_WORDS.match(text)
    if match is None:
        return None
    return _limit(match["e"], match["v"], match["a"], "", answer)


def calculus_kind(text: str, answer: str) -> Check | None:
    match = CALCULUS.match(text)
    if match is None:
        return None
    flat = plain(match["e"])
    integral = re.fullmatch(
        r"int\s*_\s*(\(.+?\)|[^\s^]+)\s*\^\s*(\(.+?\)|[^\s(]+)\s*(.+?)\s*"
        r"d\s*([a-z])",
        flat,
    )
    if integral is not None:
        low, high, body, var = integral.groups()
        return _definite(low, high, body, var, answer)
    limit = re.fullmatch(
        r"lim\s*_\s*\(\s*([a-z])\s*->\s*([^()]+?)\s*(\^\s*[-+]|[-+])?\s*\)\s*(.+)", flat
    )
    if limit is not None:
        var, point, side, body = limit.groups()
        return _limit(body, var, point, (side or "").replace("^", "").strip(), answer)
    series = re.fullmatch(
        r"sum\s*_\s*\(\s*([a-z])\s*=\s*([^()]+)\)\s*\^\s*(\(?\s*oo\s*\)?)\s*(.+)", flat
    )
    if series is not None:
        return _series(series[1], series[2], series[4], answer)
    derivative = re.fullmatch(r"(?:\(\(d\)/\(dx\)\)|d/dx)\s*(.+)", flat)
    if derivative is not None:
        return derivative_kind(f"differentiate {derivative[1]}", answer)
    return None


def _trusted(symbolic: Any, numeric: Any) -> Any:
    """A value SymPy found in closed form, if a numerical method agrees with it to 20 digits;
    else None."""
    import sympy

    if symbolic is None or symbolic.has(sympy.Integral, sympy.Limit, sympy.Sum):
        return None
    x, y = to_number(symbolic), to_number(numeric) if numeric is not None else None
    if x is None or y is None:
        return None
    if abs(complex(x - y)) <= 1e-20 * max(1.0, abs(complex(x))):
        return symbolic
    return None


def _numeric_answer(answer: str) -> Any:
    given = answer_values(answer, None)
    if given is None or len(given) != 1 or given[0].free_symbols:
        return None
    return given[0]


def _definite(low: str, high: str, body: str, var: str, answer: str) -> Check:
    import sympy

    x = sympy.Symbol(var)
    a = parse(low.strip("()") if low.startswith("(") else low, frozenset())
    b = parse(high.strip("()") if high.startswith("(") else high, frozenset())
    f = parse(body, frozenset(var))
    if f.free_symbols - {x}:
        return unchecked("an integrand in more than its variable")
    given = _numeric_answer(answer)
    if given is None:
        return unchecked("the answer is not a number")
    numeric = sympy.Integral(f, (x, a, b)).evalf(30)
    symbolic = sympy.integrate(f, (x, a, b))
    value = _trusted(symbolic, numeric)
    what = f"the integral of {shown(f)} from {shown(a)} to {shown(b)}"
    if value is None:
        if (
            to_number(numeric) is not None
            and compare(given, numeric) is not None
            and abs(complex(to_number(given) - to_number(numeric)))
            <= 1e-25 * max(1.0, abs(complex(to_number(numeric))))
        ):
            return Check(VERIFIED, f"{what} is {shown(to_number(given).round(20))}… numerically")
        return unchecked(f"{what} has no closed form SymPy trusts")
    return against(value, answer, what)


def _limit(body: str, var: str, point: str, side: str, answer: str) -> Check:
    import sympy

    x = sympy.Symbol(var)
    f = expression(body, frozenset(var))
    if f.free_symbols - {x}:
        return unchecked("a limit of more than its variable")
    a = parse(plain(point).replace("infinity", "oo"), frozenset())
    direction = {"+": "+", "-": "-"}.get(side, "+-")
    if a in (sympy.oo, -sympy.oo):
        direction = "-" if a == sympy.oo else "+"
    value = sympy.limit(f, x, a, dir=direction)
    if value.has(sympy.Limit, sympy.AccumBounds) or value.free_symbols:
        return unchecked("SymPy found no limit it trusts")
    if value in (sympy.oo, -sympy.oo):
        return unchecked("an infinite limit")

    # Cross-checked: the expression near the point, on the side(s) asked, approaches the value
    # (evaluated in floating point at 80 digits: exact powers such as (1 + 10^-16)^(10^16)
    # would be computed in full).
    def near(step: int) -> list[Any]:
        h = sympy.Float(sympy.Rational(1, 10**step), 80)
        if a in (sympy.oo, -sympy.oo):
            points = [(1 if a == sympy.oo else -1) / h]
        else:
            sides = {"+": [1], "-": [-1], "+-": [1, -1]}[direction]
            points = [a + s * h for s in sides]
        return [to_number(f.evalf(80, subs={x: point})) for point in points]

    far, close = near(8), near(16)
    target = to_number(value)
    if target is None or any(v is None for v in far + close):
        return unchecked("could not cross-check the limit numerically")
    gap_far = max(abs(complex(v - target)) for v in far)
    gap_close = max(abs(complex(v - target)) for v in close)
    if not (gap_close < 1e-6 and gap_close <= gap_far):
        return unchecked("SymPy's limit and the numbers near the point disagree")
    side_shown = {"+": "+", "-": "-"}.get(direction, "") if a not in (sympy.oo, -sympy.oo) else ""
    return against(value, answer, f"the limit of {shown(f)} as {var} -> {shown(a)}{side_shown}")


def _series(var: str, low: str, body: str, answer: str) -> Check:
    import sympy

    n = sympy.Symbol(var)
    start = parse(low, frozenset())
    term = parse(body, frozenset(var))
    if term.free_symbols - {n} or not start.is_integer:
        return unchecked("a series this room does not read")
    symbolic = sympy.summation(term, (n, start, sympy.oo))
    if symbolic in (sympy.oo, -sympy.oo) or symbolic.has(sympy.Sum):
        return unchecked("SymPy found no sum it trusts")
    numeric = sympy.Sum(term, (n, start, sympy.oo)).evalf(30)
    value = _trusted(symbolic, numeric)
    if value is None:
        return unchecked("the series' sum and its numerical value disagree")
    return against(value, answer, f"the sum of {shown(term)} from {var} = {shown(start)}")
