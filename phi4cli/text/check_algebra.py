"""Simplify, expand and factor, a kind of problem :mod:`phi4cli.text.checking` checks: the
answer is equal to the expression, and, to expand or factor it, in the form asked (no product
of sums left; as many irreducible factors as the expression has, each primitive).
"""

from __future__ import annotations

import re
from typing import Any

from phi4cli.text.check_arithmetic import arithmetic_kind
from phi4cli.text.check_reading import LETTERS, expression, function_answer
from phi4cli.text.check_values import equivalent, shown
from phi4cli.text.check_verdicts import REFUTED, VERIFIED, Check, unchecked

ALGEBRA = re.compile(
    r"^(?P<verb>simplify|expand|factor|factorise|factorize|fully\s+factor|factor\s+completely)"
    r"(?:\s+(?:completely|fully))?(?:\s+the\s+expression)?\s*:?\s*(?P<e>.+?)"
    r"(?:\s+completely)?\s*[?.]?$",
    re.I,
)


def algebra_kind(text: str, answer: str) -> Check | None:
    match = ALGEBRA.match(text)
    if match is None:
        return None
    import sympy

    verb = match["verb"].lower()
    problem = expression(match["e"], LETTERS)
    symbols = sorted(problem.free_symbols, key=str)
    given = function_answer(answer, r"(?:[a-z]\s*(?:\([a-z]\))?)", set(symbols))
    if given is None:
        if not symbols:
            return arithmetic_kind(f"what is {match['e']}", answer)  # "Simplify sqrt(242)"
        return unchecked("the answer is not an expression in the problem's letters")
    verdict = equivalent(given, problem, symbols)
    if verdict == "apart":
        return Check(REFUTED, f"the answer is not equal to {shown(problem)}")
    if verdict is None:
        return unchecked("could not compare the answer with the expression")
    if verb.startswith("simplify"):
        return Check(VERIFIED, f"the answer equals {shown(problem)}")
    written_form = function_answer(
        answer, r"(?:[a-z]\s*(?:\([a-z]\))?)", set(symbols), evaluate=False
    )
    if written_form is None:
        return unchecked("the answer equals the expression; its form could not be read")
    if verb.startswith("expand"):
        if sympy.expand(written_form) == written_form and not any(
            (isinstance(node, sympy.Pow) and isinstance(node.base, sympy.Add))
            or (isinstance(node, sympy.Mul) and any(isinstance(a, sympy.Add) for a in node.args))
            for node in sympy.preorder_traversal(written_form)
        ):
            return Check(VERIFIED, f"the answer is {shown(problem)} expanded")
        return unchecked("the answer equals the expression but is not expanded")
    # Factor: equal, and in as many irreducible factors (over the rationals) as it has.
    if len(symbols) != 1 or not problem.is_polynomial(*symbols):
        return unchecked(
            "the answer equals the expression; whether it is factored completely was not checked"
        )
    _, factors = sympy.factor_list(sympy.expand(problem))
    wanted = sum(power for _, power in factors)
    written = _written_factors(written_form)
    if not _primitive_factors(written_form, symbols[0]):
        return unchecked(
            "the answer equals the expression; a factor of it has a common factor left (2x - 4)"
        )
    if written == wanted:
        return Check(VERIFIED, f"the answer is {shown(problem)} in {wanted} irreducible factors")
    return unchecked(
        f"the answer equals the expression, but {shown(sympy.factor(problem))} has more factors"
    )


def _primitive_factors(value: Any, x: Any) -> bool:
    """Whether each non-constant factor of a product as written has coefficients with no
    common factor (``2x - 4`` has 2)."""
    import sympy

    for factor in sympy.Mul.make_args(value):
        if not factor.free_symbols:
            continue
        base = factor.as_base_exp()[0]
        try:
            content = sympy.Poly(base, x).content()
        except (sympy.PolynomialError, sympy.GeneratorsNeeded):
            return False
        if abs(content) != 1:
            return False
    return True


def _written_factors(value: Any) -> int:
    """The non-constant factors of a product as written (a power counts its exponent)."""
    import sympy

    count = 0
    for factor in sympy.Mul.make_args(value):
        if not factor.free_symbols:
            continue
        _base, exponent = factor.as_base_exp()
        count += int(exponent) if exponent.is_Integer and exponent > 0 else 1
    return count
