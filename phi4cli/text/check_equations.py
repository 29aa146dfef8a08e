"""Equations, systems and inequalities, kinds of problem :mod:`phi4cli.text.checking` checks
(``Solve ...``, ``Find all real x such that ...``): every root given is substituted, and a
polynomial's roots are all found, so a missing or extra one is seen; a system's values are
substituted, and a linear system's rank says whether they are its only solution; an
inequality in one unknown has the answer's intervals compared with its solution set.
"""

from __future__ import annotations

import re
from typing import Any

from phi4cli.text.check_reading import (
    LETTERS,
    Unreadable,
    answer_text,
    answer_values,
    expression,
    parse,
    plain,
    split_values,
)
from phi4cli.text.check_values import compare, shown, shown_short, to_number
from phi4cli.text.check_verdicts import REFUTED, VERIFIED, Check, unchecked

SOLVE = re.compile(
    r"^(?:solve(?:\s+for\s+(?P<v1>[a-z]))?(?:\s+the\s+(?:equation|inequality|system)s?)?|"
    r"find\s+all\s+(?P<real>real\s+)?(?:solutions|roots|values\s+of\s+(?P<v2>[a-z]))"
    r"(?:\s+(?:to|of|that\s+satisfy|satisfying))?(?:\s+the\s+(?:equation|inequality|system))?|"
    r"find\s+all\s+(?P<real2>real\s+)?(?:numbers\s+)?(?P<v3>[a-z])\s+(?:such\s+that|for\s+which|"
    r"with)|find\s+the\s+(?:roots|zeros|solutions)\s+of(?:\s+the\s+equation)?)"
    r"\s*:?\s*(?P<body>.+?)(?:,?\s+for\s+(?P<v4>[a-z]))?\s*[?.]?$",
    re.I,
)


def _relations(body: str) -> list[tuple[str, str, str]] | None:
    """``body`` as relations (left, operator, right); None where it is not one or more of
    them."""
    flat = plain(body)
    pieces = split_values(flat.replace(" and ", " , "))
    out: list[tuple[str, str, str]] = []
    for piece in pieces:
        parts = re.split(r"(<=|>=|!=|<|>|=)", piece)
        if len(parts) == 3:
            out.append((parts[0], parts[1], parts[2]))
        elif len(parts) == 5 and parts[1] in ("<", "<=") and parts[3] in ("<", "<="):
            out.append((parts[0], parts[1], parts[2]))
            out.append((parts[2], parts[3], parts[4]))
        else:
            return None
    return out or None


def solve_kind(text: str, answer: str) -> Check | None:
    match = SOLVE.match(text)
    if match is None:
        return None
    import sympy

    relations = _relations(match["body"])
    if relations is None:
        return unchecked("the problem's equations could not be read")
    named = match["v1"] or match["v2"] or match["v3"] or match["v4"]
    real = bool(match["real"] or match["real2"])
    sides = [(expression(lhs, LETTERS), op, expression(rhs, LETTERS)) for lhs, op, rhs in relations]
    # Where a side is undefined as written: SymPy cancels (x-3)^2/(x-3) as it parses.
    poles = _poles([text for lhs, _, rhs in relations for text in (lhs, rhs)])
    unknowns = sorted({s for lhs, _, rhs in sides for s in (lhs - rhs).free_symbols}, key=str)
    if named is not None and sympy.Symbol(named) not in unknowns:
        return unchecked(f"the problem names {named}, which its equations do not hold")
    if any(op == "=" for _, op, _ in sides) and any(op != "=" for _, op, _ in sides):
        return unchecked("equations and inequalities together (a range of x?)")
    if any(op != "=" for _, op, _ in sides):
        if len(unknowns) != 1 or any(op == "!=" for _, op, _ in sides):
            return unchecked("an inequality in more than one unknown")
        return _inequality(sides, unknowns[0], answer, poles)
    if len(unknowns) == 1 and len(sides) == 1:
        return _equation(sides[0], unknowns[0], answer, real, poles)
    return _system(sides, unknowns, answer)


def _poles(texts: list[str]) -> list[Any]:
    """The denominators of the sides as written (parsed without evaluating them): where one
    is 0, the equation is undefined."""
    import sympy

    bases = []
    for text in texts:
        for node in sympy.preorder_traversal(expression(text, LETTERS, evaluate=False)):
            if isinstance(node, sympy.Pow) and node.exp.is_number and node.exp.is_negative:
                bases.append(node.base)
    return bases


def _at_pole(poles: list[Any], x: Any, value: Any) -> str | None:
    """ "same" where ``value`` makes a denominator 0, "apart" where none, None undecided."""
    import sympy

    for base in poles:
        if not base.has(x):
            continue
        verdict = compare(base.subs(x, value), sympy.Integer(0))
        if verdict != "apart":
            return verdict
    return "apart"


def _equation(
    side: tuple[Any, str, Any], x: Any, answer: str, real: bool, poles: list[Any]
) -> Check:
    import sympy

    left, _, right = side
    relation = f"{shown(left)} = {shown(right)}"
    values = answer_values(answer, str(x))
    if values is None:
        return unchecked("the answer is not a list of values")
    for value in values:
        if value.free_symbols:
            return unchecked("the answer's values are not numbers")
        try:
            residual = (
                sympy.simplify((left - right).subs(x, value))
                if len(values) < 6
                else ((left - right).subs(x, value))
            )
        except (ArithmeticError, TypeError, ValueError):
            return unchecked("the equation could not be evaluated at the answer")
        at = [side.subs(x, value) for side in (left, right)]
        pole = _at_pole(poles, x, value)
        if pole is None:
            return unchecked(
                f"could not tell whether the equation is defined at {x} = {shown(value)}"
            )
        if pole == "same" or any(v.has(sympy.zoo, sympy.nan) for v in at):
            # Undefined there as written (a division by zero): not a solution.
            return Check(REFUTED, f"{x} = {shown(value)} is outside the equation's domain")
        if residual.has(sympy.zoo, sympy.nan) or to_number(at[0]) is None:
            return unchecked(f"could not evaluate the equation at {x} = {shown(value)}")
        if real and to_number(value) is not None and not to_number(value).is_real:
            return Check(REFUTED, f"{x} = {shown(value)} is not real")
        verdict = compare(residual, sympy.Integer(0))
        if verdict == "apart":
            return Check(
                REFUTED,
                f"{x} = {shown(value)} does not satisfy {relation} (the left "
                f"side is {shown_short(at[0])})",
            )
        if verdict is None:
            return unchecked(f"could not tell whether {x} = {shown(value)} satisfies {relation}")
    distinct = _distinct(values)
    if len(distinct) < len(values) and len(values) > 1:
        return unchecked("the answer repeats a value")
    # A polynomial's roots are all found: a missing one is seen.
    numerator = sympy.numer(sympy.together(left - right))
    if not numerator.is_polynomial(x) or sympy.degree(numerator, x) > 12:
        return unchecked(f"each value satisfies {relation}; other solutions were not looked for")
    poly = sympy.Poly(numerator, x)
    if poly.is_zero or poly.degree() < 1:
        return unchecked("an equation that holds for every or no value")
    denominator = sympy.denom(sympy.together(left - right))
    roots = []
    for root in _poly_roots(poly):
        at_pole = (
            compare(denominator.subs(x, root), sympy.Integer(0)) if denominator.has(x) else "apart"
        )
        if at_pole == "apart":
            at_pole = _at_pole(poles, x, root)
        if at_pole is None:
            return unchecked(f"each value satisfies {relation}; its roots could not all be told")
        if at_pole == "apart":  # (a root of the numerator where the equation is undefined: none)
            roots.append(root)
    real_roots = [r for r in roots if to_number(r) is not None and to_number(r).is_real]
    every = "both" if len(values) == 2 else ("the" if len(values) == 1 else "all")
    roots_word = "root" if len(values) == 1 else "roots"
    if _same_set(distinct, real_roots) or (not real and _same_set(distinct, roots)):
        others = "" if _same_set(distinct, roots) else " real"
        return Check(
            VERIFIED,
            f"{every} {roots_word} satisfy {relation}, and it has no other{others} roots"
            if len(values) > 1
            else f"{x} = {shown(values[0])} satisfies {relation}, its only{others} root",
        )
    missing = [
        r
        for r in (real_roots if real or _all_real(distinct) else roots)
        if not any(compare(r, v) == "same" for v in distinct)
    ]
    if missing:
        return Check(REFUTED, f"{relation} also has the root {x} = {shown(missing[0])}")
    return unchecked(f"each value satisfies {relation}")


def _poly_roots(poly: Any) -> list[Any]:
    import sympy

    found = sympy.roots(poly, multiple=False)
    if sum(found.values()) != poly.degree():
        # Roots in radicals not all found: the rest as CRootOf, exact all the same.
        return list(dict.fromkeys(sympy.Poly(poly).all_roots()))
    return list(found)


def _all_real(values: list[Any]) -> bool:
    return all(to_number(v) is not None and to_number(v).is_real for v in values)


def _distinct(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for value in values:
        if not any(compare(value, other) == "same" for other in out):
            out.append(value)
    return out


def _same_set(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    return all(any(compare(x, y) == "same" for y in b) for x in a)


def _system(sides: list[tuple[Any, str, Any]], unknowns: list[Any], answer: str) -> Check:
    import sympy

    if len(unknowns) > 4 or len(sides) < 2:
        return unchecked("a system this room does not read")
    assignment = _assignment(answer, unknowns)
    if assignment is None:
        return unchecked("the answer does not give each unknown one value")
    for left, _, right in sides:
        verdict = compare((left - right).subs(assignment), sympy.Integer(0))
        if verdict == "apart":
            return Check(
                REFUTED,
                f"{_shown_assignment(assignment)} does not satisfy {shown(left)} = {shown(right)}",
            )
        if verdict is None:
            return unchecked("could not evaluate the system at the answer")
    differences = [lhs - rhs for lhs, _, rhs in sides]
    if all(sympy.Poly(d, *unknowns).is_linear for d in differences):
        matrix, _ = sympy.linear_eq_to_matrix(differences, unknowns)
        if matrix.rank() == len(unknowns):
            return Check(
                VERIFIED,
                f"{_shown_assignment(assignment)} satisfies every equation, "
                "the system's only solution",
            )
    return unchecked(
        f"{_shown_assignment(assignment)} satisfies every equation; other "
        "solutions were not looked for"
    )


def _shown_assignment(assignment: dict[Any, Any]) -> str:
    return ", ".join(f"{k} = {shown(v)}" for k, v in assignment.items())


def _assignment(answer: str, unknowns: list[Any]) -> dict[Any, Any] | None:
    """The value of each unknown an answer gives: ``x = 6, y = 4`` or ``(x, y) = (6, 4)``, or a
    bare tuple ``(6, 4)`` in the unknowns' alphabetical order."""
    try:
        flat = plain(answer_text(answer))
    except Unreadable:
        return None
    names = [str(u) for u in unknowns]
    tuple_form = re.fullmatch(r"(?:\(\s*([a-z\s,]+)\)\s*=\s*)?\((.+)\)", flat.strip())
    if tuple_form is not None:
        if tuple_form[1] is None and names not in (["x", "y"], ["x", "y", "z"]):
            return None  # a bare (1, 2, 3, 4): in which order are a, b, c, d?
        order = names if tuple_form[1] is None else [n.strip() for n in tuple_form[1].split(",")]
        pieces = split_values(tuple_form[2])
        if sorted(order) != sorted(names) or len(pieces) != len(order):
            return None
        pairs = list(zip(order, pieces, strict=True))
    else:
        pairs = []
        for piece in split_values(flat):
            name, equals, value = piece.partition("=")
            if not equals:
                return None
            pairs.append((name.strip(), value))
        if sorted(n for n, _ in pairs) != sorted(names):
            return None
    try:
        import sympy

        return {sympy.Symbol(n): parse(v, frozenset()) for n, v in pairs}
    except Unreadable:
        return None


def _inequality(sides: list[tuple[Any, str, Any]], x: Any, answer: str, poles: list[Any]) -> Check:
    import sympy

    ops = {"<": sympy.Lt, "<=": sympy.Le, ">": sympy.Gt, ">=": sympy.Ge}
    if not all((left - right).is_algebraic_expr(x) for left, _, right in sides):
        # SymPy solves a periodic inequality over one period only, and says nothing of it.
        return unchecked("an inequality with functions in it (sin x > 0 holds on many intervals)")
    solution = sympy.Reals
    for base in poles:
        if base.has(x):
            zeros = sympy.solveset(base, x, sympy.Reals)
            if not isinstance(zeros, sympy.FiniteSet):
                return unchecked("an inequality whose undefined points could not be found")
            solution = sympy.Complement(solution, zeros)
    for left, op, right in sides:
        relation = ops[op](left, right)
        part = sympy.solve_univariate_inequality(relation, x, relational=False, domain=sympy.Reals)
        solution = sympy.Intersection(solution, part)
    given = _answer_set(answer, x)
    if given is None:
        return unchecked("the answer is not a set of intervals")
    difference = sympy.SymmetricDifference(solution, given)
    difference = (
        sympy.simplify(difference) if not isinstance(difference, sympy.Set) else (difference)
    )
    empty = difference.is_empty
    if empty is True:
        return Check(VERIFIED, f"the solution set is {_shown_set(solution)}")
    if empty is False:
        return Check(
            REFUTED, f"the solution set is {_shown_set(solution)}, not {_shown_set(given)}"
        )
    return unchecked("could not compare the answer's set with the solution set")


def _shown_set(value: Any) -> str:
    """A set of reals as the detail shows it: ``(2, 3) \u222a [4, oo)``."""
    import sympy

    if value == sympy.Reals:
        return "all real numbers"
    if value == sympy.EmptySet:
        return "empty"
    if isinstance(value, sympy.Union):
        return " \u222a ".join(_shown_set(part) for part in value.args)
    if isinstance(value, sympy.Interval):
        left = "(" if value.left_open else "["
        right = ")" if value.right_open else "]"
        return f"{left}{shown(value.start)}, {shown(value.end)}{right}"
    if isinstance(value, sympy.FiniteSet):
        return "{" + ", ".join(shown(v) for v in value.args) + "}"
    return shown(value)


def _answer_set(answer: str, x: Any) -> Any:
    """The set of reals an answer describes: intervals joined by a union (or "or"), ``x < 2 or
    x > 3``, ``2 < x < 3``, all real numbers; None otherwise."""
    import sympy

    try:
        flat = plain(answer_text(answer))
    except Unreadable:
        return None
    flat = flat.strip().rstrip(".")
    if re.fullmatch(r"(?:all\s+real\s+numbers|R|\(\s*-\s*oo\s*,\s*oo\s*\))", flat, re.I):
        return sympy.Reals
    if flat in ("{}", "\x01\x02", "no solution", "no real solutions"):
        return sympy.EmptySet
    pieces = re.split(r"\s+U\s+|\bor\b", flat)
    total: Any = sympy.EmptySet
    name = str(x)
    for piece in pieces:
        piece = piece.strip()
        interval = re.fullmatch(r"([(\[])\s*(.+?)\s*,\s*(.+?)\s*([)\]])", piece)
        if interval is not None:
            lo, hi = parse(interval[2], frozenset()), parse(interval[3], frozenset())
            part = sympy.Interval(
                lo, hi, interval[1] == "(" or lo == -sympy.oo, interval[4] == ")" or hi == sympy.oo
            )
        else:
            parts = re.split(r"(<=|>=|<|>)", piece)
            ops = {"<": sympy.Lt, "<=": sympy.Le, ">": sympy.Gt, ">=": sympy.Ge}
            if len(parts) == 3 and name in (parts[0].strip(), parts[2].strip()):
                relation = ops[parts[1]](
                    parse(parts[0], frozenset({name})), parse(parts[2], frozenset({name}))
                )
                part = relation.as_set()
            elif len(parts) == 5 and parts[2].strip() == name:
                low = ops[parts[1]](parse(parts[0], frozenset()), x)
                high = ops[parts[3]](x, parse(parts[4], frozenset()))
                part = sympy.Intersection(low.as_set(), high.as_set())
            else:
                return None
        total = sympy.Union(total, part)
    return total
