"""Arithmetic and number theory, kinds of problem :mod:`phi4cli.text.checking` checks: an
expression in numbers (``gcd``, ``mod``, ``!``, binomials, finite sums, roots, ``i``) evaluated
exactly, the remainder of a division, a gcd or an lcm. Each kind's pattern, and the kind: None
where a problem is not of it, else a :class:`~phi4cli.text.check_verdicts.Check`.
"""

from __future__ import annotations

import re
from typing import Any

from phi4cli.text.check_reading import Unreadable, expression, parse, plain
from phi4cli.text.check_values import against, shown
from phi4cli.text.check_verdicts import Check, unchecked

_LEAD = r"(?:what\s+is|what's|compute|calculate|evaluate|find|determine|give)"
ARITHMETIC = re.compile(rf"^(?:{_LEAD})(?:\s+the\s+value\s+of)?\s*:?\s*(?P<e>.+?)\s*[?.]?$", re.I)
REMAINDER = re.compile(
    r"^(?:what\s+is|find|compute|determine)\s+the\s+remainder\s+when\s+(?P<a>.+?)\s+is\s+"
    r"divided\s+by\s+(?P<b>.+?)\s*[?.]?$",
    re.I,
)
GCD = re.compile(
    r"^(?:what\s+is|find|compute|determine)\s+the\s+(?P<f>greatest\s+common\s+(?:divisor|factor)|"
    r"gcd|least\s+common\s+multiple|lcm)\s+of\s+(?P<a>.+?)\s+and\s+(?P<b>.+?)\s*[?.]?$",
    re.I,
)


def remainder_kind(text: str, answer: str) -> Check | None:
    match = REMAINDER.match(text)
    if match is None:
        return None
    import sympy

    a, b = expression(match["a"], frozenset()), expression(match["b"], frozenset())
    if not (a.is_integer and b.is_integer and a >= 0 and b > 0):
        return unchecked("the remainder of numbers that are not whole and positive")
    return against(
        sympy.Mod(a, b), answer, f"{_plain_shown(match['a'])} mod {_plain_shown(match['b'])}"
    )


def gcd_kind(text: str, answer: str) -> Check | None:
    match = GCD.match(text)
    if match is None:
        return None
    import sympy

    a, b = expression(match["a"], frozenset()), expression(match["b"], frozenset())
    if not (a.is_integer and b.is_integer):
        return unchecked("a gcd or lcm of numbers that are not whole")
    lcm = match["f"].lower().startswith(("least", "lcm"))
    value, name = (sympy.lcm(a, b), "lcm") if lcm else (sympy.gcd(a, b), "gcd")
    return against(value, answer, f"{name}({shown(a)}, {shown(b)})")


def arithmetic_kind(text: str, answer: str) -> Check | None:
    match = ARITHMETIC.match(text)
    if match is None:
        return None
    body = match["e"]
    mod = re.match(
        r"^(?P<a>.+?)\s*(?:\\pmod\s*\{(?P<p>[^{}]+)\}|\\bmod|\\mod|\bmod\b)\s*"
        r"(?P<b>[^{}]*)$",
        body,
    )
    try:
        if mod is not None:
            import sympy

            # "3 + 5 mod 3": (3 + 5) mod 3, or 3 + (5 mod 3)? Only a single term is read.
            if _top_level_sum(plain(mod["a"])) or re.search(r"[-+*/^]", mod["p"] or mod["b"]):
                raise Unreadable("a mod whose operands read two ways")
            a = expression(mod["a"], frozenset())
            b = expression(mod["p"] or mod["b"], frozenset())
            if not (a.is_integer and b.is_integer and a >= 0 and b > 0):
                return unchecked("a remainder of numbers that are not whole and positive")
            return against(
                sympy.Mod(a, b),
                answer,
                f"{_plain_shown(mod['a'])} mod {_plain_shown(mod['p'] or mod['b'])}",
            )
        value = _closed_sum(body) if "\\sum" in body else expression(body, frozenset())
    except Unreadable:
        return None  # not arithmetic: words, or a kind below
    if value is None or value.free_symbols:
        return None
    return against(value, answer, _plain_shown(body))


def _top_level_sum(text: str) -> bool:
    """Whether ``text`` has a + or - outside parentheses, after its first character."""
    depth = 0
    for at, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if depth == 0 and char in "+-" and at and text[:at].strip():
            return True
    return False


def _plain_shown(body: str) -> str:
    try:
        return plain(body).replace("**", "^").replace("*", "·")
    except Unreadable:
        return body


def _closed_sum(body: str) -> Any:
    """A finite sum ``\\sum_{k=1}^{n} term``, evaluated; None if it reads otherwise."""
    import sympy

    flat = plain(body)
    match = re.fullmatch(
        r"sum\s*_\s*\(\s*([a-z])\s*=\s*([^()]+)\)\s*\^\s*(\(?[^()\s]+\)?)\s*(.+)", flat
    )
    if match is None:
        return None
    var, low, high, term = match.groups()
    if "oo" in high:
        return None  # an infinite series: the calculus kind
    if _top_level_sum(term):
        raise Unreadable("a sum whose term reads two ways (the sum of k + 1?)")
    k = sympy.Symbol(var)
    lo, hi = parse(low, frozenset()), parse(high, frozenset())
    if not (lo.is_integer and hi.is_integer) or hi - lo > 100_000:
        raise Unreadable("a sum too long to add")
    return sympy.summation(parse(term, frozenset({var})), (k, lo, hi))
