"""How LaTeX→Unicode converters do on phi4's notation corpus (tests/data/notation.tsv).

    pip install flatlatex unicodeit   # the contenders, not phi4 dependencies
    python bench/notation.py

For each converter: how many of the corpus lines come out with a leftover ``\\command``, a
``^{`` or ``_{``, or a ``^`` running into a multi-character exponent (an objective count of
unreadable output), and a few lines side by side. Agreement with the corpus's expected
renderings is not counted: those were written for phi4's own renderer.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SAMPLES = [
    r"-\frac{2}{3} \pm \frac{\sqrt{2}}{3}i",
    r"\sum_{n=1}^{\infty} \frac{1}{n^s}",
    r"30^\circ",
    r"x = \frac{-b \pm \sqrt{b^2 - 4ac}}{2a}",
]


def flawed(text: str) -> bool:
    return "\\" in text or bool(re.search(r"[\^_]\{|\^[^(\s]{2}", text))


def main() -> None:
    from pylatexenc.latex2text import LatexNodes2Text

    from phi4cli.text.latex import math_to_unicode

    converters: dict[str, Callable[[str], str]] = {
        "phi4 (pylatexenc + its layer)": math_to_unicode,
        "pylatexenc alone": LatexNodes2Text(math_mode="text").latex_to_text,
    }
    try:
        import flatlatex

        converter = flatlatex.converter()
        converters["flatlatex"] = converter.convert
    except ImportError:
        print("flatlatex is not installed: skipped")
    try:
        import unicodeit

        converters["unicodeit"] = unicodeit.replace
    except ImportError:
        print("unicodeit is not installed: skipped")
    rows = [
        line.split("\t")[0]
        for line in (ROOT / "tests" / "data" / "notation.tsv").read_text().splitlines()[1:]
    ]
    print(f"| converter | unreadable lines of {len(rows)} |\n| --- | --- |")
    for name, convert in converters.items():
        bad = 0
        for latex in rows:
            try:
                bad += flawed(convert(latex))
            except Exception:
                bad += 1
        print(f"| {name} | {bad} |")
    for latex in SAMPLES:
        print(f"\n{latex}")
        for name, convert in converters.items():
            try:
                shown = convert(latex)
            except Exception as exc:
                shown = f"({type(exc).__name__})"
            print(f"  {name:30s} {shown}")


if __name__ == "__main__":
    main()
