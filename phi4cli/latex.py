"""LaTeX in model output turned into readable Unicode for the terminal (via pylatexenc).

Only math is converted — ``$...$``, ``$$...$$``, ``\\(...\\)``, ``\\[...\\]`` and bare ``\\boxed{}``
or ``\\frac{}{}`` — so Markdown around it (and a ``%`` in prose) is left alone.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

_SUPERSCRIPT = str.maketrans("0123456789+-=()nixy", "⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁼⁽⁾ⁿⁱˣʸ")
_SUBSCRIPT = str.maketrans("0123456789+-=()", "₀₁₂₃₄₅₆₇₈₉₊₋₌₍₎")
_SUPER_CHARS = set("0123456789+-=()nixy")
_SUB_CHARS = set("0123456789+-=()")

_MATH = re.compile(
    r"\$\$(?P<dd>.+?)\$\$"
    r"|\\\[(?P<bd>.+?)\\\]"
    r"|\\\((?P<bi>.+?)\\\)"
    r"|(?<![\\$])\$(?P<di>[^$\n]+?)\$",
    re.DOTALL,
)
# Math commands models also write outside any delimiters.
_BARE = re.compile(r"\\(?:boxed|dfrac|tfrac|frac|sqrt)(?![a-zA-Z])")


def _scripts(math: str) -> str:
    """Turn ``^{10}``, ``^2``, ``_{1}``, ``_1`` into Unicode super/subscripts where possible."""

    def sup(match: re.Match[str]) -> str:
        body = match.group(1) or match.group(2)
        return body.translate(_SUPERSCRIPT) if set(body) <= _SUPER_CHARS else match.group(0)

    def sub(match: re.Match[str]) -> str:
        body = match.group(1) or match.group(2)
        return body.translate(_SUBSCRIPT) if set(body) <= _SUB_CHARS else match.group(0)

    math = re.sub(r"\^\{([^{}]+)\}|\^([0-9a-z])", sup, math)
    return re.sub(r"_\{([^{}]+)\}|_([0-9])", sub, math)


def _wrap(text: str) -> str:
    return text if re.fullmatch(r"-?[\w.²³⁴⁵⁶⁷⁸⁹⁰¹]+", text) else f"({text})"


def _frac(node: Any, l2tobj: Any) -> str:
    numerator = l2tobj.nodelist_to_text([node.nodeargd.argnlist[0]]).strip()
    denominator = l2tobj.nodelist_to_text([node.nodeargd.argnlist[1]]).strip()
    return f"{_wrap(numerator)}/{_wrap(denominator)}"


def _sqrt(node: Any, l2tobj: Any) -> str:
    index_node, body_node = node.nodeargd.argnlist[0], node.nodeargd.argnlist[1]
    index = l2tobj.nodelist_to_text([index_node]).strip() if index_node is not None else ""
    root = {"3": "∛", "4": "∜"}.get(index, "√")
    body = l2tobj.nodelist_to_text([body_node]).strip()
    return root + (body if re.fullmatch(r"[\w.²³]+", body) else f"({body})")


def _boxed(node: Any, l2tobj: Any) -> str:
    return str(l2tobj.nodelist_to_text([node.nodeargd.argnlist[0]])).strip()


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
        ],
        prepend=True,
    )
    parse_context = walker_context()
    parse_context.add_context_category(
        "phi4",
        macros=[macrospec.MacroSpec(name, "{{") for name in ("dfrac", "tfrac")]
        + [macrospec.MacroSpec("boxed", "{")],
        prepend=True,
    )
    converter = LatexNodes2Text(
        latex_context=text_context, math_mode="text", strict_latex_spaces="based-on-source"
    )
    return converter, parse_context


def math_to_unicode(math: str) -> str:
    """Convert one LaTeX math expression to Unicode text (``\\frac{1}{2}`` → ``1/2``)."""
    from pylatexenc.latexwalker import LatexWalker, LatexWalkerError

    converter, parse_context = _converter()
    try:
        nodes, _, _ = LatexWalker(_scripts(math), latex_context=parse_context).get_latex_nodes()
        text: str = converter.nodelist_to_text(nodes)
    except (LatexWalkerError, IndexError, AttributeError, KeyError, TypeError):
        return math
    # pylatexenc drops the space after some symbol macros (\\leq x -> ≤x); put it back.
    text = re.sub(r"(?<= )([≤≥≠≈→⇒±\u00d7·])(?=\S)", r"\1 ", text)
    return re.sub(r"[ \t]+", " ", text).strip()


def _delimit_bare_math(text: str) -> str:
    """Wrap ``\\boxed{...}`` and friends found outside math in ``\\(...\\)``."""
    from phi4cli.reasoning import braced_group

    spans = [match.span() for match in _MATH.finditer(text)]
    out: list[str] = []
    position = 0
    for match in _BARE.finditer(text):
        start = match.start()
        if start < position or any(a <= start < b for a, b in spans):
            continue
        end = match.end()
        while True:  # consume the arguments: [optional] and {groups}, spaces between allowed
            scan = end
            while scan < len(text) and text[scan] == " ":
                scan += 1
            if scan < len(text) and text[scan] == "[" and text.find("]", scan) > 0:
                end = text.find("]", scan) + 1
                continue
            group = braced_group(text, scan) if scan < len(text) and text[scan] == "{" else None
            if group is None:
                break
            end = scan + len(group) + 2
        out.append(text[position:start] + "\\(" + text[start:end] + "\\)")
        position = end
    out.append(text[position:])
    return "".join(out)


def latex_to_unicode(text: str) -> str:
    """Convert the math inside Markdown text; display math becomes a paragraph of its own."""

    def replace(match: re.Match[str]) -> str:
        display = match.group("dd") or match.group("bd")
        if display is not None:
            return f"\n\n{math_to_unicode(display)}\n\n"
        return math_to_unicode(match.group("bi") or match.group("di"))

    converted = _MATH.sub(replace, _delimit_bare_math(text))
    return re.sub(r"\n{3,}", "\n\n", converted)
