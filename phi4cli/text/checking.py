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
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

VERIFIED, REFUTED, UNCHECKED = "verified", "refuted", "unchecked"
VERDICTS = (VERIFIED, REFUTED, UNCHECKED)


class Check(NamedTuple):
    """A verdict on an answer, and one line saying how it was reached."""

    verdict: str  # VERIFIED, REFUTED or UNCHECKED
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"verdict": self.verdict, "detail": self.detail}


def unchecked(detail: str) -> Check:
    return Check(UNCHECKED, detail)


NOT_A_KIND = "not a kind of problem phi4 checks (see docs/checking.md)"
NO_ANSWER = "no answer to check"


# --- reading the text: LaTeX, Unicode and plain text to one plain syntax ----------------------

_UNICODE = {
    "\u00d7": "*",
    "\u22c5": "*",
    "\u00b7": "*",
    "\u2219": "*",
    "\u00f7": "/",
    "\u2212": "-",
    "\u2013": "-",
    "\u2264": "<=",
    "\u2265": ">=",
    "\u2260": "!=",
    "\u03c0": "pi",
    "\u221e": "oo",
    "\u00b2": "^2",
    "\u00b3": "^3",
    "\u00b9": "^1",
    "\u2070": "^0",
    "\u2074": "^4",
    "\u2075": "^5",
    "\u2076": "^6",
    "\u2077": "^7",
    "\u2078": "^8",
    "\u2079": "^9",
    "\u00bd": "((1)/(2))",
    "\u2153": "((1)/(3))",
    "\u00bc": "((1)/(4))",
    "\u00be": "((3)/(4))",
    "\u222a": " U ",
    "\u00b1": "+-",
    "\u2205": "{}",
    "\u2192": "->",
    "\u2032": "'",
    "\u00a0": " ",
    "\u2009": " ",
    "\u202f": " ",
}

# Commands dropped (spacing, sizes) and commands that become plain words or operators.
_DROPPED = re.compile(
    r"\\(?:left|right|big|Big|bigg|Bigg|displaystyle|textstyle|limits|nolimits|mathrm|"
    r"operatorname|quad|qquad)(?![A-Za-z])|\\[,;:! ]"
)
_WORDS = {
    "cdot": "*",
    "times": "*",
    "ast": "*",
    "div": "/",
    "pi": "pi",
    "infty": "oo",
    "le": "<=",
    "leq": "<=",
    "leqslant": "<=",
    "ge": ">=",
    "geq": ">=",
    "geqslant": ">=",
    "ne": "!=",
    "neq": "!=",
    "lt": "<",
    "gt": ">",
    "cup": " U ",
    "pm": "+-",
    "mp": "-+",
    "emptyset": "{}",
    "varnothing": "{}",
    "to": "->",
    "rightarrow": "->",
    "in": " in ",
    "sin": "sin",
    "cos": "cos",
    "tan": "tan",
    "cot": "cot",
    "sec": "sec",
    "csc": "csc",
    "arcsin": "asin",
    "arccos": "acos",
    "arctan": "atan",
    "sinh": "sinh",
    "cosh": "cosh",
    "tanh": "tanh",
    "ln": "ln",
    "log": "log",
    "exp": "exp",
    "gcd": "gcd",
    "lcm": "lcm",
    "bmod": " mod ",
    "mod": " mod ",
    "land": " and ",
    "lor": " or ",
    "dots": "...",
    "ldots": "...",
    "cdots": "...",
    "mathbb": "",
    "text": "",
    "textbf": "",
    "mathbf": "",
    "mbox": "",
    "textnormal": "",
    "dfrac": "frac",
    "tfrac": "frac",
    "frac": "frac",
    "sqrt": "sqrt",
    "binom": "binom",
    "dbinom": "binom",
    "tbinom": "binom",
    "pmod": "pmod",
    "int": "int",
    "sum": "sum",
    "lim": "lim",
    "boxed": "",
    "quad": " ",
    "prime": "'",
}


class _Unreadable(Exception):
    """Text in a form this room does not read: the check is ``unchecked``."""


def _group(text: str, start: int) -> tuple[str, int]:
    """The argument of a command at ``start``: a braced group, or one character (``\\frac12``);
    return it and where it ends."""
    while start < len(text) and text[start] == " ":
        start += 1
    if start >= len(text):
        raise _Unreadable("a command without its argument")
    if text[start] != "{":
        if text[start] == "\\":
            name = re.match(r"\\[A-Za-z]+", text[start:])
            if name:
                return name.group(), start + name.end()
        return text[start], start + 1
    depth = 0
    for at in range(start, len(text)):
        if text[at] == "{":
            depth += 1
        elif text[at] == "}":
            depth -= 1
            if not depth:
                return text[start + 1 : at], at + 1
    raise _Unreadable("unbalanced braces")


def plain(text: str) -> str:
    """``text`` — LaTeX, Unicode or plain — in one plain syntax: ``frac{a}{b}`` is
    ``((a)/(b))``, ``\\sqrt`` ``sqrt(...)``, ``\\{`` ``{``; ``\\int``, ``\\sum`` and ``\\lim``
    keep their limits as ``int_(a)^(b)``. Raise _Unreadable for a command it does not know."""
    # \u221a takes a number or a letter, or a parenthesised group: \u221a3 \u00d7 \u221a3 is 3.
    text = re.sub("\u221a\\s*(\\d+(?:\\.\\d+)?|[A-Za-z])", r"sqrt(\1)", text)
    text = text.replace("\u221a(", "sqrt(")
    if "\u221a" in text:
        raise _Unreadable("a \u221a without its argument")
    for char, replacement in _UNICODE.items():
        text = text.replace(char, replacement)
    text = text.replace("$", " ").replace("\\(", " ").replace("\\)", " ")
    text = text.replace("\\[", " ").replace("\\]", " ").replace("{,}", "")
    text = text.replace("\\{", "\x01").replace("\\}", "\x02").replace("\\%", "%")
    text = _DROPPED.sub(" ", text)
    out: list[str] = []
    at = 0
    while at < len(text):
        char = text[at]
        if char != "\\":
            out.append(char)
            at += 1
            continue
        name = re.match(r"\\([A-Za-z]+)", text[at:])
        if name is None:
            raise _Unreadable(f"the command {text[at : at + 2]!r}")
        word = name.group(1)
        at += name.end()
        if word not in _WORDS:
            raise _Unreadable(f"\\{word}")
        mapped = _WORDS[word]
        if word in ("text", "textbf", "mbox", "textnormal", "mathrm", "mathbf", "mathbb"):
            inner, at = _group(text, at)
            out.append(" R " if word == "mathbb" and inner.strip() == "R" else f" {inner} ")
        elif mapped == "frac":
            top, at = _group(text, at)
            bottom, at = _group(text, at)
            out.append(f"(({plain(top)})/({plain(bottom)}))")
        elif mapped == "binom":
            top, at = _group(text, at)
            bottom, at = _group(text, at)
            out.append(f"binomial({plain(top)},{plain(bottom)})")
        elif mapped == "sqrt":
            index = None
            if text[at : at + 1] == "[":
                close = text.find("]", at)
                if close < 0:
                    raise _Unreadable("\\sqrt[ without ]")
                index, at = text[at + 1 : close], close + 1
            inner, at = _group(text, at)
            out.append(
                f"sqrt({plain(inner)})" if index is None else f"root({plain(inner)},{plain(index)})"
            )
        elif mapped == "pmod":
            inner, at = _group(text, at)
            out.append(f" mod ({plain(inner)})")
        elif word == "log" and text[at : at + 1] == "_":
            base, at = _group(text, at + 1)
            out.append(f"logbase_({plain(base)})")
        else:
            out.append(f" {mapped} " if mapped.isalpha() else mapped)
    return re.sub(r"\s+", " ", "".join(out).replace("{", "(").replace("}", ")")).strip()


# The plain syntax's tokens; anything else makes text unreadable (and so unchecked). This is
# also what makes it safe to hand to SymPy's parser, which evaluates Python: no name but these,
# no dot outside a number, no quote, bracket, underscore or attribute.
_FUNCTIONS = (
    "sin",
    "cos",
    "tan",
    "cot",
    "sec",
    "csc",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "tanh",
    "log",
    "exp",
    "sqrt",
    "root",
    "gcd",
    "lcm",
    "binomial",
    "factorial",
    "Abs",
    "Mod",
)
_NAMES = {*_FUNCTIONS, "pi", "oo", "E", "I"}
_TOKEN = re.compile(r"\s*(?:(\d+\.\d*|\.\d+|\d+)|([A-Za-z]+)|(\*\*|[-+*/^(),!]))")


def _parse(
    expression: str, variables: frozenset[str] = frozenset("xyzabcnkmtuvw"), evaluate: bool = True
) -> Any:
    """An expression of the plain syntax as SymPy's (numbers exact: ``0.1`` is 1/10). Raise
    _Unreadable for anything but numbers, the known functions and constants, single-letter
    variables among ``variables``, and ``+ - * / ^ ( ) , !`` — and for what reads two ways
    (:func:`_ambiguous`, :func:`_unclear_tokens`, :func:`_unclear_value`). ``evaluate``: False
    keeps the expression as written (``(x-3)^2/(x-3)`` is not cancelled)."""
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        rationalize,
        standard_transformations,
    )

    text = expression.strip()
    if not text:
        raise _Unreadable("an empty expression")
    if _ambiguous(text):
        raise _Unreadable("an expression that reads two ways")
    tokens: list[tuple[str, str, bool]] = []  # (kind, its text, a space before it)
    at = 0
    while at < len(text):
        match = _TOKEN.match(text, at)
        if match is None or match.end() == at:
            if text[at:].strip() == "":
                break
            raise _Unreadable(f"{text[at : at + 10]!r}")
        number, name, operator = match.groups()
        at = match.end()
        kind = "number" if number is not None else "name" if name is not None else "op"
        tokens.append((kind, number or name or operator, match.group(0)[:1].isspace()))
    _unclear_tokens(tokens)
    names: list[str] = []
    rebuilt: list[str] = []
    for index, (kind, token, _spaced) in enumerate(tokens):
        if kind == "name":
            name = token
            if name == "log":
                raise _Unreadable("log (to base 10, or e?)")
            if name not in variables:
                name = {"ln": "log", "abs": "Abs", "e": "E", "i": "I"}.get(name, name)
            if name not in _NAMES and not (len(name) == 1 and name in variables):
                # A run of variables written together (xy, xe) is their product.
                letters = [c if c in variables else {"e": "E", "i": "I"}.get(c, "") for c in name]
                if not all(letters) or len(name) > 3:
                    raise _Unreadable(f"the name {name!r}")
                if index and tokens[index - 1][1] == "/":
                    raise _Unreadable("a/bc (is it a/(bc)?)")
                rebuilt.append(" " + "*".join(letters) + " ")  # x·e^x, not (x·e)^x
                names.extend(letters)
                continue
            names.append(name)
            rebuilt.append(f" {name} ")
        elif kind == "number":
            rebuilt.append(f" {token} ")
        elif token == "!":
            _factorial(rebuilt)
        else:
            rebuilt.append(token)
    if len(rebuilt) > 400:
        raise _Unreadable("a long expression")
    source = "".join(rebuilt)
    if re.search(r"[-+]\s*[-+]", source):
        raise _Unreadable("a sign after a sign (a \\pm?)")
    if re.search(r"\^\s*\(?\s*\d+\s*\)?\s*\^", source) or re.search(r"\d{7,}\s*!", source):
        raise _Unreadable("a tower of powers or a huge factorial")
    local: dict[str, Any] = {name: sympy.Symbol(name) for name in set(names) if len(name) == 1}
    local.update({name: getattr(sympy, name) for name in _FUNCTIONS})
    local.update({"E": sympy.E, "I": sympy.I, "pi": sympy.pi, "oo": sympy.oo})
    transformations = (
        *standard_transformations,
        implicit_multiplication_application,
        convert_xor,
        rationalize,
    )
    try:
        value = parse_expr(
            source, local_dict=local, transformations=transformations, evaluate=evaluate
        )
    except (SyntaxError, TypeError, ValueError, AttributeError, IndexError) as error:
        raise _Unreadable(f"cannot parse {expression!r}") from error
    if not isinstance(value, sympy.Expr):
        raise _Unreadable(f"not an expression: {expression!r}")
    _unclear_value(value)
    return value


_TRIG = ("sin", "cos", "tan", "cot", "sec", "csc")


def _unclear_tokens(tokens: list[tuple[str, str, bool]]) -> None:
    """Raise _Unreadable where the tokens (kind, text, whether a space came before it) read
    two ways: ``5!!`` (a double factorial?), numbers side by side (``1 000``, ``1 1/2``),
    ``1.2e5``, ``0.(3)``, a function whose argument has no parentheses and is followed by more
    than + or - (``sin pi/6``, ``sin x cos x``, ``sin^2 x``), and an exponent of a number with a
    letter or a bracket written against it (``e^2x``: e^(2x)?)."""
    ends = {"+", "-", ")", ",", "="}
    count = len(tokens)
    for index, (kind, token, _spaced) in enumerate(tokens):
        after = tokens[index + 1] if index + 1 < count else None
        then = tokens[index + 2] if index + 2 < count else None
        if token == "!" and after is not None and after[1] == "!":
            raise _Unreadable("n!! (a double factorial?)")
        if kind == "number" and after is not None:
            if after[0] == "number":
                raise _Unreadable("numbers side by side")
            if token.endswith("."):
                raise _Unreadable(f"{token} followed by more")
            if (
                after[0] == "name"
                and after[1][0] in "eE"
                and not after[2]
                and (
                    any(c.isdigit() for c in after[1]) or (then is not None and then[0] == "number")
                )
            ):
                raise _Unreadable("a number in e-notation")
        if (
            kind == "name"
            and token in (*_FUNCTIONS, "ln", "log")
            and (after is None or after[1] != "(")
        ):
            if after is None or after[0] == "op":
                raise _Unreadable(f"{token} without its argument")
            if then is not None and then[1] not in ends:
                raise _Unreadable(f"{token} whose argument has no parentheses")
        if token == "^" and after is not None and after[0] == "number" and then is not None:
            written_against = not then[2] and (
                (then[0] == "name" and then[1] not in _NAMES) or then[1] == "("
            )
            if written_against:
                raise _Unreadable("an exponent of a number and then more (e^2x)")


def _unclear_value(value: Any) -> None:
    """Raise _Unreadable for what SymPy would read another way than a person: an odd root of
    what may be negative (SymPy's is complex: its cube root of -8 is not -2), and a
    trigonometric function of a plain number (degrees or radians?)."""
    import sympy

    for node in sympy.preorder_traversal(value):
        if isinstance(node, sympy.Pow):
            exponent = node.exp
            if exponent.is_Rational and not exponent.is_Integer and exponent.q % 2 == 1:
                base = node.base
                if not (base.is_number and base.is_positive):
                    raise _Unreadable("an odd root of what may be negative")
        elif isinstance(node, sympy.Function) and node.func.__name__ in _TRIG:
            argument = node.args[0]
            if argument.is_number and not argument.has(sympy.pi) and argument != 0:
                raise _Unreadable("a trigonometric function of a plain number (degrees?)")


def _factorial(rebuilt: list[str]) -> None:
    """Make the operand that ends ``rebuilt`` (a number, a name, a parenthesised group) its
    factorial: ``7!``, ``(3!)!``."""
    if not rebuilt:
        raise _Unreadable("a factorial of nothing")
    if rebuilt[-1] != ")":
        if rebuilt[-1] in ("(", ",", "+", "-", "*", "/", "^", "**"):
            raise _Unreadable("a factorial of nothing")
        rebuilt[-1] = f"factorial({rebuilt[-1]})"
        return
    depth = 0
    for at in range(len(rebuilt) - 1, -1, -1):
        depth += rebuilt[at].count(")") - rebuilt[at].count("(")
        if depth == 0:
            if at and rebuilt[at - 1].strip().isalpha():
                at -= 1  # sqrt(x)!: the call is the operand
            rebuilt[at:] = ["factorial(" + "".join(rebuilt[at:]) + ")"]
            return
    raise _Unreadable("unbalanced parentheses")


def _ambiguous(text: str) -> bool:
    """Whether a plain expression reads two ways: a division followed by a product written by
    juxtaposition (``6/2(1+2)``), a number before a fraction (``1\\frac{4}{5}``: a mixed
    number or a product), or a function's argument without parentheses followed by more
    (``sin x + 1`` is clear, ``sin 2x`` is not)."""
    if re.search(r"/\s*[\w.]+\s*\(", text) or re.search(r"/\s*\d+\s*[A-Za-z]", text):
        return True
    if re.search(r"\d\s*\(\(", text):
        return True
    # -3^2 (is it 9 or -9?) and a/b/c (is it a/(b/c)?): conventions a reader may not share.
    if re.search(r"(?:^|[-+*/(,^=])\s*-\s*\d+(?:\.\d+)?\s*\^", text):
        return True
    return bool(re.search(r"/\s*[\w.]+\s*/", text)) or _unary_function(text)


def _unary_function(text: str) -> bool:
    """``sin 2x``: a function's argument without parentheses, followed by more."""
    return bool(re.search(r"\b(?:sin|cos|tan|log|ln|exp|sqrt)\s+\d+\s*[A-Za-z(]", text))


def expression(
    text: str, variables: frozenset[str] = frozenset("xyzabcnkmtuvw"), evaluate: bool = True
) -> Any:
    """LaTeX, Unicode or plain text as a SymPy expression (``evaluate``: False, as written);
    raise _Unreadable."""
    flat = plain(text)
    if re.search(r"[<>=]|\bU\b|->|\.\.|%", flat):
        raise _Unreadable("not a single expression")
    flat = flat.rstrip(" .,;")
    flat = re.sub(r"\blogbase_\(([^()]*)\)\s*\(", r"logb(\1,", flat)
    if "logbase_" in flat or "logb" in flat:
        raise _Unreadable("a logarithm to a base")
    return _parse(flat, variables, evaluate)


# --- comparing values ------------------------------------------------------------------------

DIGITS = 50  # precision of numerical comparisons
ROUNDS = 12  # random points an equivalence is judged at (those where both sides are real)
SAME = 1e-40  # relative difference under which two values are one
APART = 1e-10  # relative difference over which they are two


def _number(value: Any) -> Any:
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


def _compare(a: Any, b: Any) -> str | None:
    """ "same", "apart" or None (undecided) for two numbers."""
    import sympy

    if isinstance(a, sympy.Rational) and isinstance(b, sympy.Rational):
        return "same" if a == b else "apart"  # exact
    x, y = _number(a), _number(b)
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
        return _compare(a, b)
    try:
        difference = sympy.expand(a - b)
    except (TypeError, ValueError, ArithmeticError, RecursionError):
        difference = None
    if difference == 0:
        return "same"
    if difference is not None and not difference.free_symbols:
        return _compare(difference, sympy.Integer(0))  # x + 10^-60 and x: apart, exactly
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
            x = _number(a.subs(at))
            y = _number(b.subs(at))
        except (TypeError, ValueError, ArithmeticError, RecursionError):
            continue
        real = [v is not None and v.is_real for v in (x, y)]
        if not any(real):
            continue
        if not all(real):
            return None  # defined at this point on one side only: another domain
        verdict = _compare(x, y)
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


def _short(value: Any) -> str:
    """A number as the detail shows it: exact where it is rational, else to 8 digits."""
    import sympy

    simpler = sympy.nsimplify(value) if value.is_number and not value.has(sympy.Float) else value
    if isinstance(simpler, sympy.Rational):
        return shown(simpler)
    number = _number(value)
    return shown(value) if number is None else shown(sympy.N(number, 8))


def shown(value: Any) -> str:
    """A SymPy value as the detail line shows it: ``156``, ``-1/3``, ``sqrt(2)``, ``x^2 + 1``."""
    import sympy

    text = sympy.sstr(value, order="grlex") if isinstance(value, sympy.Basic) else str(value)
    return text.replace("**", "^").replace("*", "·").replace("I", "i")


# --- reading answers ---------------------------------------------------------------------------

_CONSTANT = re.compile(r"\s*\+\s*(?:C|c|K|C_?1|\\text\{\s*[Cc]onstant\s*\}|constant)\s*$")


def _answer_text(answer: str) -> str:
    text = answer.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(left) and text.endswith(right) and len(text) > len(left + right):
            text = text[len(left) : -len(right)]
    text = re.sub(r"^\\boxed\{(.*)\}$", r"\1", text.strip(), flags=re.S).strip()
    if re.search(r"(?:\.\.\.|\u2026|\\[lc]?dots|\\overline)", text):
        raise _Unreadable("a repeating decimal or a list that goes on")
    if re.search(r"\d(?:,|\\,|\{,\}|\\ )\d{3}(?!\d)", text):
        raise _Unreadable("digits grouped in thousands, or a list (1,000?)")
    return text[:-1].strip() if text.endswith(".") else text


def _split_values(text: str) -> list[str]:
    """Top-level pieces of a list of values: commas, semicolons, "or" and "and" outside
    parentheses."""
    pieces: list[str] = []
    depth = 0
    current = ""
    words = re.split(r"(\bor\b|\band\b|[,;()\[\]])", text)
    for word in words:
        if word in ("(", "["):
            depth += 1
        elif word in (")", "]"):
            depth -= 1
        if depth == 0 and word in (",", ";", "or", "and"):
            pieces.append(current)
            current = ""
        else:
            current += word
    pieces.append(current)
    return [p.strip() for p in pieces if p.strip()]


def answer_values(answer: str, unknown: str | None) -> list[Any] | None:
    """The values an answer gives for ``unknown`` (``x = 2 or x = 3``, ``\\{2, 3\\}``,
    ``x = \\pm 2``, ``2, 3``), or None when it reads otherwise."""
    try:
        flat = plain(_answer_text(answer))
    except _Unreadable:
        return None
    flat = flat.strip()
    if flat.startswith("\x01") and flat.endswith("\x02"):
        flat = flat[1:-1]
    values: list[Any] = []
    for piece in _split_values(flat):
        piece = piece.strip()
        if "=" in piece:
            name, _, piece = piece.partition("=")
            if unknown is None or name.strip() != unknown:
                return None
            piece = piece.strip()
        signs = [1]
        if piece.startswith("+-"):
            signs, piece = [1, -1], piece[2:]
        try:
            value = _parse(piece, frozenset())
        except _Unreadable:
            return None
        values.extend(sign * value for sign in signs)
    return values or None


# --- the kinds of problem ----------------------------------------------------------------------

_LEAD = r"(?:what\s+is|what's|compute|calculate|evaluate|find|determine|give)"
_ARITHMETIC = re.compile(rf"^(?:{_LEAD})(?:\s+the\s+value\s+of)?\s*:?\s*(?P<e>.+?)\s*[?.]?$", re.I)
_REMAINDER = re.compile(
    r"^(?:what\s+is|find|compute|determine)\s+the\s+remainder\s+when\s+(?P<a>.+?)\s+is\s+"
    r"divided\s+by\s+(?P<b>.+?)\s*[?.]?$",
    re.I,
)
_GCD = re.compile(
    r"^(?:what\s+is|find|compute|determine)\s+the\s+(?P<f>greatest\s+common\s+(?:divisor|factor)|"
    r"gcd|least\s+common\s+multiple|lcm)\s+of\s+(?P<a>.+?)\s+and\s+(?P<b>.+?)\s*[?.]?$",
    re.I,
)
_SOLVE = re.compile(
    r"^(?:solve(?:\s+for\s+(?P<v1>[a-z]))?(?:\s+the\s+(?:equation|inequality|system)s?)?|"
    r"find\s+all\s+(?P<real>real\s+)?(?:solutions|roots|values\s+of\s+(?P<v2>[a-z]))"
    r"(?:\s+(?:to|of|that\s+satisfy|satisfying))?(?:\s+the\s+(?:equation|inequality|system))?|"
    r"find\s+all\s+(?P<real2>real\s+)?(?:numbers\s+)?(?P<v3>[a-z])\s+(?:such\s+that|for\s+which|"
    r"with)|find\s+the\s+(?:roots|zeros|solutions)\s+of(?:\s+the\s+equation)?)"
    r"\s*:?\s*(?P<body>.+?)(?:,?\s+for\s+(?P<v4>[a-z]))?\s*[?.]?$",
    re.I,
)
_DERIVATIVE = re.compile(
    r"^(?:(?:find|compute|what\s+is|calculate|determine|give)\s+the\s+derivative\s+of|"
    r"differentiate)\s*:?\s*(?:(?:f|g|y)\s*(?:\(x\))?\s*=\s*)?(?P<e>.+?)"
    r"(?:\s+with\s+respect\s+to\s+x)?\s*[?.]?$",
    re.I,
)
_INTEGRAL_WORDS = re.compile(
    r"^(?:(?:find|compute|evaluate|calculate|what\s+is)\s+)?(?:the\s+)?"
    r"(?:(?:indefinite\s+)?integral|antiderivative)\s+of\s+(?P<e>.+?)"
    r"(?:\s+(?:with\s+respect\s+to|dx|d\s*x)\s*x?)?\s*[?.]?$|"
    r"^integrate\s*:?\s*(?P<e2>.+?)(?:\s+with\s+respect\s+to\s+x)?\s*[?.]?$",
    re.I,
)
_CALCULUS = re.compile(
    r"^(?:(?:find|compute|evaluate|calculate|determine|what\s+is|integrate)\s*(?:the\s+value\s+of"
    r"|the\s+integral|the\s+limit|the\s+sum)?\s*:?\s*)?(?P<e>.*(?:\\int|\\lim|\\sum|\\frac\{d\}"
    r"\{dx\}|d/dx).*?)\s*[?.]?$",
    re.I | re.S,
)
_ALGEBRA = re.compile(
    r"^(?P<verb>simplify|expand|factor|factorise|factorize|fully\s+factor|factor\s+completely)"
    r"(?:\s+(?:completely|fully))?(?:\s+the\s+expression)?\s*:?\s*(?P<e>.+?)"
    r"(?:\s+completely)?\s*[?.]?$",
    re.I,
)
_LIMIT_WORDS = re.compile(
    r"^(?:find|compute|evaluate|what\s+is)\s+the\s+limit\s+of\s+(?P<e>.+?)\s+as\s+(?P<v>[a-z])\s+"
    r"(?:approaches|goes\s+to|tends\s+to)\s+(?P<a>.+?)\s*[?.]?$",
    re.I,
)


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
            _REMAINDER,
            _GCD,
            _SOLVE,
            _DERIVATIVE,
            _INTEGRAL_WORDS,
            _ALGEBRA,
            _LIMIT_WORDS,
            _CALCULUS,
            _ARITHMETIC,
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
        except _Unreadable as why:
            return unchecked(f"could not read {why}")
        except (RecursionError, MemoryError):
            return unchecked("too large to check")
        except Exception as error:  # SymPy's failures are many: never a verdict
            return unchecked(f"SymPy could not decide ({type(error).__name__})")
        if found is not None:
            if found.verdict == REFUTED and _has_decimal(answer) and kind not in _EXACT_KINDS:
                # A decimal answer to an equation, a derivative...: perhaps rounded.
                return unchecked(f"a decimal answer, which may be rounded ({found.detail})")
            return _bounded(found)
    return unchecked(NOT_A_KIND)


DETAIL_CHARS = 160  # of a detail line: a 5,000-digit number is not worth a screen


def _bounded(found: Check) -> Check:
    if len(found.detail) <= DETAIL_CHARS:
        return found
    return Check(found.verdict, found.detail[: DETAIL_CHARS - 1] + "\u2026")


# Each kind returns None when the problem is not of it (the next is tried), else a Check.


def _remainder(text: str, answer: str) -> Check | None:
    match = _REMAINDER.match(text)
    if match is None:
        return None
    import sympy

    a, b = expression(match["a"], frozenset()), expression(match["b"], frozenset())
    if not (a.is_integer and b.is_integer and a >= 0 and b > 0):
        return unchecked("the remainder of numbers that are not whole and positive")
    return _against(
        sympy.Mod(a, b), answer, f"{_plain_shown(match['a'])} mod {_plain_shown(match['b'])}"
    )


def _gcd(text: str, answer: str) -> Check | None:
    match = _GCD.match(text)
    if match is None:
        return None
    import sympy

    a, b = expression(match["a"], frozenset()), expression(match["b"], frozenset())
    if not (a.is_integer and b.is_integer):
        return unchecked("a gcd or lcm of numbers that are not whole")
    lcm = match["f"].lower().startswith(("least", "lcm"))
    value, name = (sympy.lcm(a, b), "lcm") if lcm else (sympy.gcd(a, b), "gcd")
    return _against(value, answer, f"{name}({shown(a)}, {shown(b)})")


def _against(value: Any, answer: str, what: str) -> Check:
    """A computed exact ``value`` (``what``, as the detail names it) against the answer."""
    given = answer_values(answer, None)
    if given is None or len(given) != 1:
        return unchecked("the answer is not one number")
    verdict = _compare(given[0], value)
    if verdict == "same":
        return Check(VERIFIED, f"{what} = {shown(value)}")
    if verdict == "apart":
        if _rounded(answer, given[0], value):
            return unchecked(f"{what} = {_short(value)}: the answer may be it rounded")
        return Check(REFUTED, f"{what} = {_short(value)}, not {_short(given[0])}")
    return unchecked(f"could not compare the answer with {what} = {shown(value)}")


def _rounded(answer: str, given: Any, value: Any) -> bool:
    """Whether an answer written with a decimal point may be ``value`` rounded (``0.333`` for
    1/3, ``1.2158 \\times 10^{19}`` for 3^40): within half a unit of its last place, or 1%:
    not a wrong value, so no refutation."""
    if not _has_decimal(answer):
        return False
    places = max(len(d) for d in re.findall(r"\.(\d+)", answer))
    x, y = _number(given), _number(value)
    if x is None or y is None:
        return True  # (undecided: say nothing against it)
    try:
        gap = abs(complex(x - y))
        return gap <= 0.5001 * 10.0**-places or gap <= 0.01 * abs(complex(y))
    except (TypeError, ValueError, OverflowError):
        return True


def _has_decimal(answer: str) -> bool:
    return re.search(r"\d?\.\d", answer) is not None


def _arithmetic(text: str, answer: str) -> Check | None:
    match = _ARITHMETIC.match(text)
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
                raise _Unreadable("a mod whose operands read two ways")
            a = expression(mod["a"], frozenset())
            b = expression(mod["p"] or mod["b"], frozenset())
            if not (a.is_integer and b.is_integer and a >= 0 and b > 0):
                return unchecked("a remainder of numbers that are not whole and positive")
            return _against(
                sympy.Mod(a, b),
                answer,
                f"{_plain_shown(mod['a'])} mod {_plain_shown(mod['p'] or mod['b'])}",
            )
        value = _closed_sum(body) if "\\sum" in body else expression(body, frozenset())
    except _Unreadable:
        return None  # not arithmetic: words, or a kind below
    if value is None or value.free_symbols:
        return None
    return _against(value, answer, _plain_shown(body))


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
    except _Unreadable:
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
        raise _Unreadable("a sum whose term reads two ways (the sum of k + 1?)")
    k = sympy.Symbol(var)
    lo, hi = _parse(low, frozenset()), _parse(high, frozenset())
    if not (lo.is_integer and hi.is_integer) or hi - lo > 100_000:
        raise _Unreadable("a sum too long to add")
    return sympy.summation(_parse(term, frozenset({var})), (k, lo, hi))


# --- equations, systems, inequalities -----------------------------------------------------------


def _relations(body: str) -> list[tuple[str, str, str]] | None:
    """``body`` as relations (left, operator, right); None where it is not one or more of
    them."""
    flat = plain(body)
    pieces = _split_values(flat.replace(" and ", " , "))
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


def _solve(text: str, answer: str) -> Check | None:
    match = _SOLVE.match(text)
    if match is None:
        return None
    import sympy

    relations = _relations(match["body"])
    if relations is None:
        return unchecked("the problem's equations could not be read")
    named = match["v1"] or match["v2"] or match["v3"] or match["v4"]
    real = bool(match["real"] or match["real2"])
    sides = [
        (expression(lhs, _LETTERS), op, expression(rhs, _LETTERS)) for lhs, op, rhs in relations
    ]
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
        for node in sympy.preorder_traversal(expression(text, _LETTERS, evaluate=False)):
            if isinstance(node, sympy.Pow) and node.exp.is_number and node.exp.is_negative:
                bases.append(node.base)
    return bases


def _at_pole(poles: list[Any], x: Any, value: Any) -> str | None:
    """ "same" where ``value`` makes a denominator 0, "apart" where none, None undecided."""
    import sympy

    for base in poles:
        if not base.has(x):
            continue
        verdict = _compare(base.subs(x, value), sympy.Integer(0))
        if verdict != "apart":
            return verdict
    return "apart"


_LETTERS = frozenset("abcdfghjklmnpqrstuvwxyz")  # (e and i are constants)


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
        if residual.has(sympy.zoo, sympy.nan) or _number(at[0]) is None:
            return unchecked(f"could not evaluate the equation at {x} = {shown(value)}")
        if real and _number(value) is not None and not _number(value).is_real:
            return Check(REFUTED, f"{x} = {shown(value)} is not real")
        verdict = _compare(residual, sympy.Integer(0))
        if verdict == "apart":
            return Check(
                REFUTED,
                f"{x} = {shown(value)} does not satisfy {relation} (the left "
                f"side is {_short(at[0])})",
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
            _compare(denominator.subs(x, root), sympy.Integer(0)) if denominator.has(x) else "apart"
        )
        if at_pole == "apart":
            at_pole = _at_pole(poles, x, root)
        if at_pole is None:
            return unchecked(f"each value satisfies {relation}; its roots could not all be told")
        if at_pole == "apart":  # (a root of the numerator where the equation is undefined: none)
            roots.append(root)
    real_roots = [r for r in roots if _number(r) is not None and _number(r).is_real]
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
        if not any(_compare(r, v) == "same" for v in distinct)
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
    return all(_number(v) is not None and _number(v).is_real for v in values)


def _distinct(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for value in values:
        if not any(_compare(value, other) == "same" for other in out):
            out.append(value)
    return out


def _same_set(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    return all(any(_compare(x, y) == "same" for y in b) for x in a)


def _system(sides: list[tuple[Any, str, Any]], unknowns: list[Any], answer: str) -> Check:
    import sympy

    if len(unknowns) > 4 or len(sides) < 2:
        return unchecked("a system this room does not read")
    assignment = _assignment(answer, unknowns)
    if assignment is None:
        return unchecked("the answer does not give each unknown one value")
    for left, _, right in sides:
        verdict = _compare((left - right).subs(assignment), sympy.Integer(0))
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
        flat = plain(_answer_text(answer))
    except _Unreadable:
        return None
    names = [str(u) for u in unknowns]
    tuple_form = re.fullmatch(r"(?:\(\s*([a-z\s,]+)\)\s*=\s*)?\((.+)\)", flat.strip())
    if tuple_form is not None:
        if tuple_form[1] is None and names not in (["x", "y"], ["x", "y", "z"]):
            return None  # a bare (1, 2, 3, 4): in which order are a, b, c, d?
        order = names if tuple_form[1] is None else [n.strip() for n in tuple_form[1].split(",")]
        pieces = _split_values(tuple_form[2])
        if sorted(order) != sorted(names) or len(pieces) != len(order):
            return None
        pairs = list(zip(order, pieces, strict=True))
    else:
        pairs = []
        for piece in _split_values(flat):
            name, equals, value = piece.partition("=")
            if not equals:
                return None
            pairs.append((name.strip(), value))
        if sorted(n for n, _ in pairs) != sorted(names):
            return None
    try:
        import sympy

        return {sympy.Symbol(n): _parse(v, frozenset()) for n, v in pairs}
    except _Unreadable:
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
        flat = plain(_answer_text(answer))
    except _Unreadable:
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
            lo, hi = _parse(interval[2], frozenset()), _parse(interval[3], frozenset())
            part = sympy.Interval(
                lo, hi, interval[1] == "(" or lo == -sympy.oo, interval[4] == ")" or hi == sympy.oo
            )
        else:
            parts = re.split(r"(<=|>=|<|>)", piece)
            ops = {"<": sympy.Lt, "<=": sympy.Le, ">": sympy.Gt, ">=": sympy.Ge}
            if len(parts) == 3 and name in (parts[0].strip(), parts[2].strip()):
                relation = ops[parts[1]](
                    _parse(parts[0], frozenset({name})), _parse(parts[2], frozenset({name}))
                )
                part = relation.as_set()
            elif len(parts) == 5 and parts[2].strip() == name:
                low = ops[parts[1]](_parse(parts[0], frozenset()), x)
                high = ops[parts[3]](x, _parse(parts[4], frozenset()))
                part = sympy.Intersection(low.as_set(), high.as_set())
            else:
                return None
        total = sympy.Union(total, part)
    return total


# --- calculus ----------------------------------------------------------------------------------


def _derivative(text: str, answer: str) -> Check | None:
    match = _DERIVATIVE.match(text)
    if match is None:
        return None
    import sympy

    x = sympy.Symbol("x")
    f = expression(match["e"], frozenset("x"))
    if f.free_symbols - {x}:
        return unchecked("a function of more than x")
    given = _function_answer(answer, r"(?:f'\s*\(x\)|y'|g'\s*\(x\)|dy/dx|d/dx\s*\(.*\))", {x})
    if given is None:
        return unchecked("the answer is not an expression in x")
    derivative = sympy.diff(f, x)
    verdict = equivalent(given, derivative, [x])
    if verdict == "same":
        return Check(VERIFIED, f"d/dx {shown(f)} = {shown(derivative)}")
    if verdict == "apart":
        return Check(REFUTED, f"d/dx {shown(f)} = {shown(derivative)}, not {shown(given)}")
    return unchecked("could not compare the answer with the derivative")


def _function_answer(
    answer: str, prefix: str, allowed: set[Any], constant: bool = False, evaluate: bool = True
) -> Any:
    """The expression an answer gives (``f'(x) = ...`` taken off; with ``constant``, an
    antiderivative's ``+ C`` too; ``evaluate`` False: as written, 2(x - 2) not made 2x - 4),
    or None."""
    text = _answer_text(answer)
    if constant:
        text = _CONSTANT.sub("", text)
    try:
        flat = plain(text)
    except _Unreadable:
        return None
    flat = re.sub(rf"^{prefix}\s*=\s*", "", flat).strip()
    if constant:
        flat = re.sub(r"\+\s*C\s*$", "", flat).strip()
    try:
        value = _parse(flat, frozenset(str(s) for s in allowed), evaluate)
    except _Unreadable:
        return None
    return value if value.free_symbols <= allowed else None


def _antiderivative(text: str, answer: str) -> Check | None:
    match = _INTEGRAL_WORDS.match(text)
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
    given = _function_answer(answer, r"(?:F\s*\(x\))", {x}, constant=True)
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


def _limit_words(text: str, answer: str) -> Check | None:
    match = _LIMIT_WORDS.match(text)
    if match is None:
        return None
    return _limit(match["e"], match["v"], match["a"], "", answer)


def _calculus(text: str, answer: str) -> Check | None:
    match = _CALCULUS.match(text)
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
        return _derivative(f"differentiate {derivative[1]}", answer)
    return None


def _trusted(symbolic: Any, numeric: Any) -> Any:
    """A value SymPy found in closed form, if a numerical method agrees with it to 20 digits;
    else None."""
    import sympy

    if symbolic is None or symbolic.has(sympy.Integral, sympy.Limit, sympy.Sum):
        return None
    x, y = _number(symbolic), _number(numeric) if numeric is not None else None
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
    a = _parse(low.strip("()") if low.startswith("(") else low, frozenset())
    b = _parse(high.strip("()") if high.startswith("(") else high, frozenset())
    f = _parse(body, frozenset(var))
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
            _number(numeric) is not None
            and _compare(given, numeric) is not None
            and abs(complex(_number(given) - _number(numeric)))
            <= 1e-25 * max(1.0, abs(complex(_number(numeric))))
        ):
            return Check(VERIFIED, f"{what} is {shown(_number(given).round(20))}… numerically")
        return unchecked(f"{what} has no closed form SymPy trusts")
    return _against(value, answer, what)


def _limit(body: str, var: str, point: str, side: str, answer: str) -> Check:
    import sympy

    x = sympy.Symbol(var)
    f = expression(body, frozenset(var))
    if f.free_symbols - {x}:
        return unchecked("a limit of more than its variable")
    a = _parse(plain(point).replace("infinity", "oo"), frozenset())
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
        return [_number(f.evalf(80, subs={x: point})) for point in points]

    far, close = near(8), near(16)
    target = _number(value)
    if target is None or any(v is None for v in far + close):
        return unchecked("could not cross-check the limit numerically")
    gap_far = max(abs(complex(v - target)) for v in far)
    gap_close = max(abs(complex(v - target)) for v in close)
    if not (gap_close < 1e-6 and gap_close <= gap_far):
        return unchecked("SymPy's limit and the numbers near the point disagree")
    side_shown = {"+": "+", "-": "-"}.get(direction, "") if a not in (sympy.oo, -sympy.oo) else ""
    return _against(value, answer, f"the limit of {shown(f)} as {var} -> {shown(a)}{side_shown}")


def _series(var: str, low: str, body: str, answer: str) -> Check:
    import sympy

    n = sympy.Symbol(var)
    start = _parse(low, frozenset())
    term = _parse(body, frozenset(var))
    if term.free_symbols - {n} or not start.is_integer:
        return unchecked("a series this room does not read")
    symbolic = sympy.summation(term, (n, start, sympy.oo))
    if symbolic in (sympy.oo, -sympy.oo) or symbolic.has(sympy.Sum):
        return unchecked("SymPy found no sum it trusts")
    numeric = sympy.Sum(term, (n, start, sympy.oo)).evalf(30)
    value = _trusted(symbolic, numeric)
    if value is None:
        return unchecked("the series' sum and its numerical value disagree")
    return _against(value, answer, f"the sum of {shown(term)} from {var} = {shown(start)}")


# --- simplify, expand, factor ---------------------------------------------------------------


def _algebra(text: str, answer: str) -> Check | None:
    match = _ALGEBRA.match(text)
    if match is None:
        return None
    import sympy

    verb = match["verb"].lower()
    problem = expression(match["e"], _LETTERS)
    symbols = sorted(problem.free_symbols, key=str)
    given = _function_answer(answer, r"(?:[a-z]\s*(?:\([a-z]\))?)", set(symbols))
    if given is None:
        if not symbols:
            return _arithmetic(f"what is {match['e']}", answer)  # "Simplify sqrt(242)"
        return unchecked("the answer is not an expression in the problem's letters")
    verdict = equivalent(given, problem, symbols)
    if verdict == "apart":
        return Check(REFUTED, f"the answer is not equal to {shown(problem)}")
    if verdict is None:
        return unchecked("could not compare the answer with the expression")
    if verb.startswith("simplify"):
        return Check(VERIFIED, f"the answer equals {shown(problem)}")
    written_form = _function_answer(
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


# Kinds that weigh a decimal answer's rounding themselves (_against).
_EXACT_KINDS: tuple[Callable[[str, str], Check | None], ...] = (_remainder, _gcd, _arithmetic)

_KINDS: tuple[Callable[[str, str], Check | None], ...] = (
    _remainder,
    _gcd,
    _solve,
    _derivative,
    _antiderivative,
    _limit_words,
    _algebra,
    _calculus,
    _arithmetic,
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
