"""Reading text for :mod:`phi4cli.text.checking`: a problem's or an answer's LaTeX, Unicode or
plain text in one plain syntax (:func:`plain`), that syntax as a SymPy expression
(:func:`parse`, :func:`expression`), and an answer as the values it gives
(:func:`answer_values`) or the expression it gives (:func:`function_answer`).

The plain syntax's few tokens are also what makes text safe to hand to SymPy's parser. Text in
a form not read here, or that reads two ways (``6/2(1+2)``, ``sin 2x``, ``1 000``), raises
:class:`Unreadable`: its check is ``unchecked``. SymPy is imported when first needed.
"""

from __future__ import annotations

import re
from typing import Any

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


class Unreadable(Exception):
    """Text in a form this room does not read: the check is ``unchecked``."""


def _group(text: str, start: int) -> tuple[str, int]:
    """The argument of a command at ``start``: a braced group, or one character (``\\frac12``);
    return it and where it ends."""
    while start < len(text) and text[start] == " ":
        start += 1
    if start >= len(text):
        raise Unreadable("a command without its argument")
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
    raise Unreadable("unbalanced braces")


def plain(text: str) -> str:
    """``text`` — LaTeX, Unicode or plain — in one plain syntax: ``frac{a}{b}`` is
    ``((a)/(b))``, ``\\sqrt`` ``sqrt(...)``, ``\\{`` ``{``; ``\\int``, ``\\sum`` and ``\\lim``
    keep their limits as ``int_(a)^(b)``. Raise Unreadable for a command it does not know."""
    # \u221a takes a number or a letter, or a parenthesised group: \u221a3 \u00d7 \u221a3 is 3.
    text = re.sub("\u221a\\s*(\\d+(?:\\.\\d+)?|[A-Za-z])", r"sqrt(\1)", text)
    text = text.replace("\u221a(", "sqrt(")
    if "\u221a" in text:
        raise Unreadable("a \u221a without its argument")
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
            raise Unreadable(f"the command {text[at : at + 2]!r}")
        word = name.group(1)
        at += name.end()
        if word not in _WORDS:
            raise Unreadable(f"\\{word}")
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
                    raise Unreadable("\\sqrt[ without ]")
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


def parse(
    expression: str, variables: frozenset[str] = frozenset("xyzabcnkmtuvw"), evaluate: bool = True
) -> Any:
    """An expression of the plain syntax as SymPy's (numbers exact: ``0.1`` is 1/10). Raise
    Unreadable for anything but numbers, the known functions and constants, single-letter
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
        raise Unreadable("an empty expression")
    if _ambiguous(text):
        raise Unreadable("an expression that reads two ways")
    tokens: list[tuple[str, str, bool]] = []  # (kind, its text, a space before it)
    at = 0
    while at < len(text):
        match = _TOKEN.match(text, at)
        if match is None or match.end() == at:
            if text[at:].strip() == "":
                break
            raise Unreadable(f"{text[at : at + 10]!r}")
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
                raise Unreadable("log (to base 10, or e?)")
            if name not in variables:
                name = {"ln": "log", "abs": "Abs", "e": "E", "i": "I"}.get(name, name)
            if name not in _NAMES and not (len(name) == 1 and name in variables):
                # A run of variables written together (xy, xe) is their product.
                letters = [c if c in variables else {"e": "E", "i": "I"}.get(c, "") for c in name]
                if not all(letters) or len(name) > 3:
                    raise Unreadable(f"the name {name!r}")
                if index and tokens[index - 1][1] == "/":
                    raise Unreadable("a/bc (is it a/(bc)?)")
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
        raise Unreadable("a long expression")
    source = "".join(rebuilt)
    if re.search(r"[-+]\s*[-+]", source):
        raise Unreadable("a sign after a sign (a \\pm?)")
    if re.search(r"\^\s*\(?\s*\d+\s*\)?\s*\^", source) or re.search(r"\d{7,}\s*!", source):
        raise Unreadable("a tower of powers or a huge factorial")
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
        raise Unreadable(f"cannot parse {expression!r}") from error
    if not isinstance(value, sympy.Expr):
        raise Unreadable(f"not an expression: {expression!r}")
    _unclear_value(value)
    return value


_TRIG = ("sin", "cos", "tan", "cot", "sec", "csc")


def _unclear_tokens(tokens: list[tuple[str, str, bool]]) -> None:
    """Raise Unreadable where the tokens (kind, text, whether a space came before it) read
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
            raise Unreadable("n!! (a double factorial?)")
        if kind == "number" and after is not None:
            if after[0] == "number":
                raise Unreadable("numbers side by side")
            if token.endswith("."):
                raise Unreadable(f"{token} followed by more")
            if (
                after[0] == "name"
                and after[1][0] in "eE"
                and not after[2]
                and (
                    any(c.isdigit() for c in after[1]) or (then is not None and then[0] == "number")
                )
            ):
                raise Unreadable("a number in e-notation")
        if (
            kind == "name"
            and token in (*_FUNCTIONS, "ln", "log")
            and (after is None or after[1] != "(")
        ):
            if after is None or after[0] == "op":
                raise Unreadable(f"{token} without its argument")
            if then is not None and then[1] not in ends:
                raise Unreadable(f"{token} whose argument has no parentheses")
        if token == "^" and after is not None and after[0] == "number" and then is not None:
            written_against = not then[2] and (
                (then[0] == "name" and then[1] not in _NAMES) or then[1] == "("
            )
            if written_against:
                raise Unreadable("an exponent of a number and then more (e^2x)")


def _unclear_value(value: Any) -> None:
    """Raise Unreadable for what SymPy would read another way than a person: an odd root of
    what may be negative (SymPy's is complex: its cube root of -8 is not -2), and a
    trigonometric function of a plain number (degrees or radians?)."""
    import sympy

    for node in sympy.preorder_traversal(value):
        if isinstance(node, sympy.Pow):
            exponent = node.exp
            if exponent.is_Rational and not exponent.is_Integer and exponent.q % 2 == 1:
                base = node.base
                if not (base.is_number and base.is_positive):
                    raise Unreadable("an odd root of what may be negative")
        elif isinstance(node, sympy.Function) and node.func.__name__ in _TRIG:
            argument = node.args[0]
            if argument.is_number and not argument.has(sympy.pi) and argument != 0:
                raise Unreadable("a trigonometric function of a plain number (degrees?)")


def _factorial(rebuilt: list[str]) -> None:
    """Make the operand that ends ``rebuilt`` (a number, a name, a parenthesised group) its
    factorial: ``7!``, ``(3!)!``."""
    if not rebuilt:
        raise Unreadable("a factorial of nothing")
    if rebuilt[-1] != ")":
        if rebuilt[-1] in ("(", ",", "+", "-", "*", "/", "^", "**"):
            raise Unreadable("a factorial of nothing")
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
    raise Unreadable("unbalanced parentheses")


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
    raise Unreadable."""
    flat = plain(text)
    if re.search(r"[<>=]|\bU\b|->|\.\.|%", flat):
        raise Unreadable("not a single expression")
    flat = flat.rstrip(" .,;")
    flat = re.sub(r"\blogbase_\(([^()]*)\)\s*\(", r"logb(\1,", flat)
    if "logbase_" in flat or "logb" in flat:
        raise Unreadable("a logarithm to a base")
    return parse(flat, variables, evaluate)


LETTERS = frozenset("abcdfghjklmnpqrstuvwxyz")  # (e and i are constants)


# --- reading answers ---------------------------------------------------------------------------

_CONSTANT = re.compile(r"\s*\+\s*(?:C|c|K|C_?1|\\text\{\s*[Cc]onstant\s*\}|constant)\s*$")


def answer_text(answer: str) -> str:
    text = answer.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(left) and text.endswith(right) and len(text) > len(left + right):
            text = text[len(left) : -len(right)]
    text = re.sub(r"^\\boxed\{(.*)\}$", r"\1", text.strip(), flags=re.S).strip()
    if re.search(r"(?:\.\.\.|\u2026|\\[lc]?dots|\\overline)", text):
        raise Unreadable("a repeating decimal or a list that goes on")
    if re.search(r"\d(?:,|\\,|\{,\}|\\ )\d{3}(?!\d)", text):
        raise Unreadable("digits grouped in thousands, or a list (1,000?)")
    return text[:-1].strip() if text.endswith(".") else text


def split_values(text: str) -> list[str]:
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
        flat = plain(answer_text(answer))
    except Unreadable:
        return None
    flat = flat.strip()
    if flat.startswith("\x01") and flat.endswith("\x02"):
        flat = flat[1:-1]
    values: list[Any] = []
    for piece in split_values(flat):
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
            value = parse(piece, frozenset())
        except Unreadable:
            return None
        values.extend(sign * value for sign in signs)
    return values or None


def function_answer(
    answer: str, prefix: str, allowed: set[Any], constant: bool = False, evaluate: bool = True
) -> Any:
    """The expression an answer gives (``f'(x) = ...`` taken off; with ``constant``, an
    antiderivative's ``+ C`` too; ``evaluate`` False: as written, 2(x - 2) not made 2x - 4),
    or None."""
    text = answer_text(answer)
    if constant:
        text = _CONSTANT.sub("", text)
    try:
        flat = plain(text)
    except Unreadable:
        return None
    flat = re.sub(rf"^{prefix}\s*=\s*", "", flat).strip()
    if constant:
        flat = re.sub(r"\+\s*C\s*$", "", flat).strip()
    try:
        value = parse(flat, frozenset(str(s) for s in allowed), evaluate)
    except Unreadable:
        return None
    return value if value.free_symbols <= allowed else None
