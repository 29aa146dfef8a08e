"""LaTeX in model output turned into readable Unicode for the terminal (via pylatexenc).

Only math is converted — ``$...$``, ``$$...$$``, ``\\(...\\)``, ``\\[...\\]`` and bare ``\\boxed{}``
or ``\\frac{}{}`` — so Markdown around it (and a ``%`` in prose) is left alone.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

_SUPER_FROM = "0123456789+-=()abcdefghijklmnoprstuvwxyzABDEGHIJKLMNOPRTUVW"
_SUPER_TO = "⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁼⁽⁾ᵃᵇᶜᵈᵉᶠᵍʰⁱʲᵏˡᵐⁿᵒᵖʳˢᵗᵘᵛʷˣʸᶻᴬᴮᴰᴱᴳᴴᴵᴶᴷᴸᴹᴺᴼᴾᴿᵀᵁⱽᵂ"
_SUB_FROM = "0123456789+-=()aehijklmnoprstuvx"
_SUB_TO = "₀₁₂₃₄₅₆₇₈₉₊₋₌₍₎ₐₑₕᵢⱼₖₗₘₙₒₚᵣₛₜᵤᵥₓ"
_SUPERSCRIPT = str.maketrans(_SUPER_FROM, _SUPER_TO)
_SUBSCRIPT = str.maketrans(_SUB_FROM, _SUB_TO)
_SUPER_CHARS = set(_SUPER_FROM)
_SUB_CHARS = set(_SUB_FROM)
# Big operators whose bounds are written as sub- and superscripts.
_BIG = {
    "sum": "∑",
    "prod": "∏",
    "int": "∫",
    "iint": "∬",
    "iiint": "∭",
    "oint": "∮",
    "bigcup": "\u22c3",
    "bigcap": "\u22c2",
    "lim": "lim",
    "max": "max",
    "min": "min",
    "sup": "sup",
    "inf": "inf",
}

# Where math may open: $$, \[, \( or $ (a $ after \ or $ opens nothing).
_MATH_OPEN = re.compile(r"\$\$|\\\[|\\\(|(?<![\\$])\$")
_DISPLAY, _INLINE = "display", "inline"


class _Closers:
    """Where each closing delimiter occurs in a text, to find the first one after a point in
    O(log n): a lazy regex (``\\[(.+?)\\]``) rescans to the end from every opener that is
    never closed, which is quadratic (10 KB of ``\\[`` took 2 s)."""

    def __init__(self, text: str) -> None:
        self._at = {
            mark: [m.start() for m in re.finditer(f"(?={re.escape(mark)})", text)]
            for mark in ("$$", "\\]", "\\)")
        }

    def after(self, mark: str, start: int) -> int:
        """The first index >= start where ``mark`` occurs, or -1."""
        at = self._at[mark]
        index = bisect.bisect_left(at, start)
        return at[index] if index < len(at) else -1


def _math_matches(text: str) -> list[tuple[int, int, str, str]]:
    """The math of a text, in order, without overlaps: (start, end, kind, content) for each
    ``$$...$$`` and ``\\[...\\]`` (display) and ``\\(...\\)`` and one-line ``$...$`` (inline).
    Content is never empty; linear in the text (up to a log factor)."""
    closers = _Closers(text)
    found: list[tuple[int, int, str, str]] = []
    position = 0
    while (opener := _MATH_OPEN.search(text, position)) is not None:
        start, mark = opener.start(), opener.group()
        position = start + 1  # unless it opens math: then on after it, as a regex scan goes on
        if mark == "$":
            close = text.find("$", start + 1)
            if close > start + 1 and "\n" not in text[start + 1 : close]:
                found.append((start, close + 1, _INLINE, text[start + 1 : close]))
                position = close + 1
            continue
        closer = {"$$": "$$", "\\[": "\\]", "\\(": "\\)"}[mark]
        close = closers.after(closer, start + 3)  # at least one character of math
        if close >= 0:
            kind = _INLINE if mark == "\\(" else _DISPLAY
            found.append((start, close + 2, kind, text[start + 2 : close]))
            position = close + 2
    return found


# Math commands models also write outside any delimiters.
_BARE = re.compile(r"\\(?:boxed|dfrac|tfrac|frac|sqrt)(?![a-zA-Z])")
# Math environments models also write outside any delimiters; each is shown as display math.
_BARE_ENVIRONMENT = re.compile(
    r"\\begin\{((?:align|aligned|alignat|gather|gathered|equation|eqnarray|multline|split"
    r"|cases|array|[pbvBV]?matrix)\*?)\}"
)
# What is converted at all: conversion nests (a script's body is converted as math of its own),
# so deep or huge input would cost time without bound; beyond these it is shown as written.
MAX_MATH_CHARS = 2_000  # one math expression
MAX_MATH_DEPTH = 24  # nested {groups} in one expression
MAX_TEXT_CHARS = 100_000  # a whole solution
# The work of converting a solution, in units of about 10 µs: each expression costs a fixed
# part and its length times its depth (a nested script is converted again inside its parent).
# Real solutions cost a few thousand; the costliest converted takes about a second at worst.
MAX_CONVERSION_COST = 100_000
_GROUP_BRACE = re.compile(r"(?<!\\)[{}]")


def _depth(math: str) -> int:
    """How deeply ``{groups}`` nest in ``math``, counted up to just past MAX_MATH_DEPTH."""
    depth = deepest = 0
    for match in _GROUP_BRACE.finditer(math):
        depth += 1 if match.group() == "{" else -1
        deepest = max(deepest, depth)
        if deepest > MAX_MATH_DEPTH:
            break
    return deepest


def _too_deep(math: str) -> bool:
    return _depth(math) > MAX_MATH_DEPTH


def _conversion_cost(spans: list[str]) -> int:
    cost = 0
    for math in spans:
        if len(math) > MAX_MATH_CHARS or _too_deep(math):
            cost += len(math) // 100  # shown as written: only the check costs
        else:
            cost += 30 + len(math) * (1 + _depth(math))
    return cost


def _scripts(math: str) -> str:
    """Turn ``^{10}``, ``^2``, ``_{1}``, ``_1`` into Unicode super/subscripts where possible,
    and the rest into ``^(...)`` and ``_(...)``, so a script never runs into what follows."""

    out: list[str] = []
    position = 0
    for match in re.finditer(r"(?<!\\)[\^_]", math):
        if match.start() < position:
            continue
        found = _group_at(math, match.end())
        if found is None:
            continue
        raw, end = found
        if raw.startswith("\\") and raw[1:].isalpha() and raw not in ("\\infty", "\\prime"):
            continue  # ^\command with arguments: leave it to the parser
        body = math_to_unicode(raw) if "\\" in raw or "{" in raw else _scripts(raw.strip())
        table, chars = (
            (_SUPERSCRIPT, _SUPER_CHARS) if match.group(0) == "^" else (_SUBSCRIPT, _SUB_CHARS)
        )
        if body and set(body) <= chars:
            shown = body.translate(table)
        else:
            shown = match.group(0) + (body if len(body) == 1 else f"({body})")
        out.append(math[position : match.start()] + shown)
        position = end
    out.append(math[position:])
    return "".join(out)


def _group_at(math: str, start: int) -> tuple[str, int] | None:
    """The script argument at ``start`` (``{...}``, or one character or command); with its end."""
    from phi4cli.text.reasoning import braced_group

    while start < len(math) and math[start].isspace():
        start += 1
    if start >= len(math):
        return None
    if math[start] == "{":
        group = braced_group(math, start)
        return None if group is None else (group, start + len(group) + 2)
    command = re.match(r"\\[a-zA-Z]+|.", math[start:], re.DOTALL)
    if command is None:
        return None
    return command.group(0), start + len(command.group(0))


def _big_operators(math: str) -> str:
    """``\\sum_{n=1}^{\\infty}`` → ``∑(n=1..∞)``; ``\\lim_{x \\to 0}`` → ``lim(x→0)``;
    ``\\int_0^1`` → ``∫₀¹`` (small bounds as scripts)."""
    out: list[str] = []
    position = 0
    for match in re.finditer(r"\\(" + "|".join(_BIG) + r")(?![a-zA-Z])", math):
        if match.start() < position:
            continue
        bounds: dict[str, str] = {}
        end = match.end()
        while True:
            rest = math[end:].lstrip(" ")
            mark = rest[:1]
            if mark not in ("_", "^") or mark in bounds:
                break
            found = _group_at(math, len(math) - len(rest) + 1)
            if found is None:
                break
            bounds[mark], end = found
        symbol = _BIG[match.group(1)]
        low = math_to_unicode(bounds["_"]) if "_" in bounds else ""
        high = math_to_unicode(bounds["^"]) if "^" in bounds else ""
        if not bounds:
            shown = symbol
        elif (
            symbol in ("∫", "∮", "∬", "∭") and set(low) <= _SUB_CHARS and set(high) <= _SUPER_CHARS
        ):
            shown = symbol + low.translate(_SUBSCRIPT) + high.translate(_SUPERSCRIPT)
        elif high:
            shown = f"{symbol}({low}..{high})"
        else:
            shown = f"{symbol}({low.replace(' ', '')})"
        follows = math[end:].lstrip(" ")[:1]
        space = " " if bounds or (follows and follows not in "(["[:2]) else ""
        out.append(math[position : match.start()] + shown + space)
        position = end
    out.append(math[position:])
    return "".join(out)


def _delimiter(written: str) -> str:
    """What ``\\left`` or ``\\right`` leaves: the delimiter (``\\{`` kept escaped, so it is not
    taken for a group), or nothing for ``.``."""
    if written in ("\\{", "\\}"):
        return written
    return written.lstrip("\\").replace(".", "")


def _environments(math: str) -> str:
    """``cases`` as ``{a if c; b if d}``; ``vmatrix`` as ``|a b; c d|`` (pylatexenc has the
    bracketed matrices)."""

    def rows(body: str) -> list[list[str]]:
        return [
            [cell.strip() for cell in row.split("&")]
            for row in re.split(r"\\\\", body)
            if row.strip()
        ]

    def cases(match: re.Match[str]) -> str:
        parts = []
        for row in rows(match.group(1)):
            value = row[0]
            condition = row[1] if len(row) > 1 else ""
            condition = re.sub(r"^\\text\{\s*(?:if\s+)?([^{}]*)\}", r"\1", condition).strip()
            parts.append(f"{value} \\text{{ if }} {condition}" if condition else value)
        return "\\{" + "; ".join(parts) + "\\}"

    def determinant(match: re.Match[str]) -> str:
        return "|" + "; ".join(" ".join(row) for row in rows(match.group(1))) + "|"

    math = re.sub(r"\\begin\{cases\}(.*?)\\end\{cases\}", cases, math, flags=re.DOTALL)
    return re.sub(r"\\begin\{vmatrix\}(.*?)\\end\{vmatrix\}", determinant, math, flags=re.DOTALL)


def _group_fractions(math: str) -> str:
    """A fraction followed at once by a letter or command (``\\frac{\\sqrt2}{3}i``) is put in
    parentheses, so ``√2/3i`` cannot be read as √2/(3i); a digit before one (``1\\frac12``,
    a mixed number) is kept apart from it."""
    out: list[str] = []
    position = 0
    for match in re.finditer(r"\\[dt]?frac(?![a-zA-Z])", math):
        if match.start() < position:
            continue
        end = match.end()
        for _ in range(2):
            found = _group_at(math, end)
            if found is None:
                break
            end = found[1]
        else:
            before = math[position : match.start()]
            fraction = math[match.start() : end]
            after = math[end:]
            if re.match(
                r"[a-zA-Z(]|\\(?:sqrt|pi|theta|alpha|beta|gamma|phi|omega|lambda|mu)"
                r"(?![a-zA-Z])",
                after,
            ):
                fraction = f"({fraction})"
            if before[-1:].isdigit():
                before += " "
            out.append(before + fraction)
            position = end
    out.append(math[position:])
    return "".join(out)


def _wrap(text: str, numerator: bool = False) -> str:
    """A numerator or denominator as written, or in parentheses unless it is one number or one
    symbol (``2a`` is wrapped: ``1/2a`` would read as (1/2)a; a numerator may be ``3π``).
    Differentials (``dx``, ``∂f``) and factorials (``n!``) count as one symbol."""
    compact = re.sub(r"^(d|∂)\s+(?=\w)", r"\1", text)
    if re.fullmatch(r"(?:d|∂)[A-Za-z\u0391-\u03c9]", compact):
        return compact
    if numerator and re.fullmatch(r"-?\d+(?:[√∛∜]\d+|[A-Za-z\u0391-\u03c9])", text):
        return text
    single = r"-?[√∛∜]?(?:\d+(?:\.\d+)?|[A-Za-z\u0391-\u03c9])[" + _SUPER_TO + "]*!?"
    return text if re.fullmatch(single, text) else f"({text})"


def _frac(node: Any, l2tobj: Any) -> str:
    numerator = l2tobj.nodelist_to_text([node.nodeargd.argnlist[0]]).strip()
    denominator = l2tobj.nodelist_to_text([node.nodeargd.argnlist[1]]).strip()
    return f"{_wrap(numerator, numerator=True)}/{_wrap(denominator)}"


def _sqrt(node: Any, l2tobj: Any) -> str:
    index_node, body_node = node.nodeargd.argnlist[0], node.nodeargd.argnlist[1]
    index = l2tobj.nodelist_to_text([index_node]).strip() if index_node is not None else ""
    root = {"3": "∛", "4": "∜"}.get(index, "√")
    body = l2tobj.nodelist_to_text([body_node]).strip()
    return root + (body if re.fullmatch(r"[\w.²³]+", body) else f"({body})")


def _boxed(node: Any, l2tobj: Any) -> str:
    # An empty box is shown as one (□), not as nothing: "within ." hid that it was empty.
    return str(l2tobj.nodelist_to_text([node.nodeargd.argnlist[0]])).strip() or "□"


def _binom(node: Any, l2tobj: Any) -> str:
    top = l2tobj.nodelist_to_text([node.nodeargd.argnlist[0]]).strip()
    bottom = l2tobj.nodelist_to_text([node.nodeargd.argnlist[1]]).strip()
    return f"C({top}, {bottom})"


def _pmod(node: Any, l2tobj: Any) -> str:
    return f" (mod {str(l2tobj.nodelist_to_text([node.nodeargd.argnlist[0]])).strip()})"


def _arrow(node: Any, l2tobj: Any) -> str:
    """A vector arrow over the last character (``\\overrightarrow{AB}`` → ``AB⃗``)."""
    return str(l2tobj.nodelist_to_text([node.nodeargd.argnlist[0]])).strip() + "\u20d7"


def _overline(node: Any, l2tobj: Any) -> str:
    """A bar over each character (``0.\\overline{3}`` → ``0.3̅``, a repeating decimal)."""
    body = str(l2tobj.nodelist_to_text([node.nodeargd.argnlist[0]])).strip()
    return "".join(char + "\u0305" for char in body)


@lru_cache(maxsize=1)
def _converter() -> tuple[Any, Any]:
    from pylatexenc import macrospec
    from pylatexenc.latex2text import (
        LatexNodes2Text,
        MacroTextSpec,
        get_default_latex_context_db,
    )
    from pylatexenc.latexwalker import get_default_latex_context_db as walker_context

    text_context = get_default_latex_context_db()
    text_context.add_context_category(
        "phi4",
        macros=[
            MacroTextSpec("frac", simplify_repl=_frac),
            MacroTextSpec("dfrac", simplify_repl=_frac),
            MacroTextSpec("tfrac", simplify_repl=_frac),
            MacroTextSpec("sqrt", simplify_repl=_sqrt),
            MacroTextSpec("boxed", simplify_repl=_boxed),
            MacroTextSpec("binom", simplify_repl=_binom),
            MacroTextSpec("dbinom", simplify_repl=_binom),
            MacroTextSpec("tbinom", simplify_repl=_binom),
            MacroTextSpec("overline", simplify_repl=_overline),
            MacroTextSpec("triangle", simplify_repl="△"),
            MacroTextSpec("pmod", simplify_repl=_pmod),
            MacroTextSpec("overrightarrow", simplify_repl=_arrow),
            MacroTextSpec("vv", simplify_repl=_arrow),
            MacroTextSpec("mod", simplify_repl=" mod "),
            MacroTextSpec("bmod", simplify_repl=" mod "),
            MacroTextSpec("ne", simplify_repl="≠"),
            MacroTextSpec("neg", simplify_repl="¬"),
            MacroTextSpec("lor", simplify_repl="\u2228"),
            MacroTextSpec("land", simplify_repl="∧"),
            MacroTextSpec("|", simplify_repl="‖"),
            MacroTextSpec("lvert", simplify_repl="|"),
            MacroTextSpec("rvert", simplify_repl="|"),
            MacroTextSpec("lVert", simplify_repl="‖"),
            MacroTextSpec("rVert", simplify_repl="‖"),
            # Line-breaking hints (a soft hyphen, a word joiner, a zero-width non-joiner) mean
            # nothing on a terminal, which would show them as <U+00AD> and the like.
            MacroTextSpec("-", simplify_repl=""),
            MacroTextSpec("nolinebreak", simplify_repl=""),
            MacroTextSpec("textcompwordmark", simplify_repl=""),
            *(
                MacroTextSpec(name, simplify_repl=name)
                for name in (
                    "det",
                    "gcd",
                    "lcm",
                    "deg",
                    "dim",
                    "ker",
                    "arg",
                    "exp",
                    "sgn",
                    "sec",
                    "csc",
                    "cot",
                    "sinh",
                    "cosh",
                    "tanh",
                    "arcsin",
                    "arccos",
                    "arctan",
                )
            ),
        ],
        prepend=True,
    )
    parse_context = walker_context()
    parse_context.add_context_category(
        "phi4",
        macros=[
            macrospec.MacroSpec(name, "{{")
            for name in ("dfrac", "tfrac", "binom", "dbinom", "tbinom")
        ]
        + [
            macrospec.MacroSpec(name, "{")
            for name in ("boxed", "overline", "pmod", "overrightarrow", "vv")
        ],
        prepend=True,
    )
    converter = LatexNodes2Text(
        latex_context=text_context, math_mode="text", strict_latex_spaces="based-on-source"
    )
    return converter, parse_context


@lru_cache(maxsize=2048)  # the live view converts the same expressions on every refresh
def math_to_unicode(math: str) -> str:
    """Convert one LaTeX math expression to Unicode text (``\\frac{1}{2}`` → ``1/2``); one longer
    than MAX_MATH_CHARS or nested deeper than MAX_MATH_DEPTH is returned as written."""
    from pylatexenc.latexwalker import LatexWalker

    if len(math) > MAX_MATH_CHARS or _too_deep(math):
        return math
    converter, parse_context = _converter()
    math = re.sub(r"\^\s*(?:\{\s*\\circ\s*\}|\\circ(?![a-zA-Z]))", "°", math)  # degrees
    math = re.sub(r"'{2}", "″", re.sub(r"'{3}", "‴", math))
    math = re.sub(r"'", "′", math)  # noqa: RUF001 - the prime sign is meant
    math = _environments(math)
    # (√3)² rather than √3², which could be √(3²)
    math = re.sub(r"(\\sqrt(?:\[[^\]]*\])?\{[^{}]*\})(?=\s*\^)", r"(\1)", math)
    math = re.sub(r"\\left\s*\\lvert", r"\\left|", re.sub(r"\\right\s*\\rvert", r"\\right|", math))
    # \left( x \right) and friends: the delimiter itself, without the source's inner spaces.
    math = re.sub(r"\\left\s*(\\?[(\[|.{])\s*", lambda m: _delimiter(m.group(1)), math)
    math = re.sub(r"\s*\\right\s*(\\?[)\]|.}])", lambda m: _delimiter(m.group(1)), math)
    try:
        prepared = _scripts(_group_fractions(_big_operators(math)))
        nodes, _, _ = LatexWalker(prepared, latex_context=parse_context).get_latex_nodes()
        text: str = converter.nodelist_to_text(nodes)
    except Exception:
        return math
    # pylatexenc drops the space after some symbol macros (\\leq x -> ≤x); put it back.
    text = re.sub(r"(?<= )([≤≥≠≈→⇒±\u00d7·∈∉⊂⊆∪∩])(?=\S)", r"\1 ", text)  # noqa: RUF001
    text = re.sub(r"([⌊⌈(\[⟨])\s+", r"\1", text)  # ⌊ x ⌋ -> ⌊x⌋
    text = re.sub(r"\s+([⌋⌉)\]⟩])", r"\1", text)
    binary = "≈≡\u223c∥⊥·\u00d7÷"  # approx, equiv, sim, parallel, perp, times...: spaced
    text = re.sub(rf"(?<=\S)\s*([{binary}])\s*(?=\S)", r" \1 ", text)
    # A function before a Greek letter loses the source's space (\tan \theta -> tanθ).
    text = re.sub(
        r"(?<![A-Za-z])(sin|cos|tan|cot|sec|csc|ln|log|exp|det)(?=[\u0391-\u03c9])", r"\1 ", text
    )
    text = re.sub(r"(?<=\S)\s*([±∓])\s*(?=\S)", r" \1 ", text)  # a ± b, not a± b
    return re.sub(r"[ \t]+", " ", text).strip()


def _wrap_outside_math(
    text: str,
    pattern: re.Pattern[str],
    extent: Callable[[re.Match[str]], int | None],
    opening: str,
    closing: str,
) -> str:
    """Wrap each match of ``pattern`` that is not inside math in ``opening``...``closing``, up
    to where ``extent`` says it ends (None: it is left as it is)."""
    spans = [(start, end) for start, end, _kind, _math in _math_matches(text)]
    starts = [a for a, _b in spans]
    out: list[str] = []
    position = 0
    for match in pattern.finditer(text):
        start = match.start()
        inside = bisect.bisect_right(starts, start) - 1  # the last math span opening before it
        if start < position or (inside >= 0 and start < spans[inside][1]):
            continue
        end = extent(match)
        if end is None:
            continue
        out.append(text[position:start] + opening + text[start:end] + closing)
        position = end
    out.append(text[position:])
    return "".join(out)


def _delimit_bare_environments(text: str) -> str:
    """Wrap ``\\begin{align*}...\\end{align*}`` and the other math environments found outside
    math in ``\\[...\\]``, so that they are converted (and their rows kept) as display math."""
    if "\\begin{" not in text:
        return text

    def extent(match: re.Match[str]) -> int | None:
        closer = f"\\end{{{match.group(1)}}}"
        close = text.find(closer, match.end())
        return close + len(closer) if close >= 0 else None

    return _wrap_outside_math(text, _BARE_ENVIRONMENT, extent, "\\[", "\\]")


def _display(shown: str) -> str:
    """Converted display math as a paragraph of its own, each row (``\\\\``) on its own line: a
    Markdown hard break ends each, where a plain newline would run the rows together."""
    rows = [row.strip() for row in shown.split("\n")]
    return "\n\n" + "  \n".join(row for row in rows if row) + "\n\n"


def _delimit_bare_math(text: str) -> str:
    """Wrap ``\\boxed{...}`` and friends found outside math in ``\\(...\\)``, and math
    environments in ``\\[...\\]``."""
    from phi4cli.text.reasoning import braced_group

    text = _delimit_bare_environments(text)

    def extent(match: re.Match[str]) -> int:
        end = match.end()
        while True:  # consume the arguments: [optional] and {groups}, spaces between allowed
            scan = end
            while scan < len(text) and text[scan] == " ":
                scan += 1
            close = text.find("]", scan, scan + 200) if text[scan : scan + 1] == "[" else -1
            if close > 0:  # \\sqrt[3]: a short optional argument (sought within 200 characters)
                end = close + 1
                continue
            group = braced_group(text, scan) if scan < len(text) and text[scan] == "{" else None
            if group is None:
                return end
            end = scan + len(group) + 2

    return _wrap_outside_math(text, _BARE, extent, "\\(", "\\)")


def latex_to_unicode(text: str) -> str:
    """Convert the math inside Markdown text; display math becomes a paragraph of its own.

    A text longer than MAX_TEXT_CHARS, or whose math would cost more than MAX_CONVERSION_COST to
    convert, is returned as written: the cost stays bounded whatever the model wrote."""
    if len(text) > MAX_TEXT_CHARS:
        return text
    delimited = _delimit_bare_math(text)
    matches = _math_matches(delimited)
    if _conversion_cost([math for _start, _end, _kind, math in matches]) > MAX_CONVERSION_COST:
        return text
    out: list[str] = []
    position = 0
    for start, end, kind, math in matches:
        shown = math_to_unicode(math)
        if kind == _DISPLAY:
            shown = _display(shown)
        else:
            shown = " ".join(part.strip() for part in shown.split("\n") if part.strip())
        out.append(delimited[position:start] + shown)
        position = end
    out.append(delimited[position:])
    return re.sub(r"\n{3,}", "\n\n", "".join(out))
