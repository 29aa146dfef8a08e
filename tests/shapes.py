"""Reasoning that repeats its shape while it makes progress, and reasoning that loops.

The progressing shapes are what real math brings and what a loop rule must let run to the end:
matrices written out in full (identity, near-identity powers, sparse, tridiagonal), case tables
("n = k: ... holds" for hundreds of k), sums and products written term by term (hundreds of
equal terms), a formula re-verified over many cases with the same phrasing, enumerations, long
decimal expansions, digit cycles, truth tables and long multiplication. Each generator writes at
least ``words`` words (whitespace-separated), deterministically for a seed.

The loops are what a reasoning model falls into: a block of text that recurs verbatim, or with a
few words changed among variants it has written before, with nothing new between its copies.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from fractions import Fraction

from tests.traces import normal_trace

PROSE = (
    "Let me write this out carefully so I don't lose track.",
    "Okay, continuing with the next one.",
    "Let me check that this is consistent with the pattern so far.",
    "Hmm, so far so good.",
    "Let me keep going.",
)


def _words(parts: list[str]) -> int:
    return sum(len(part.split()) for part in parts)


def _pmatrix(rows: list[list[int]]) -> str:
    body = " \\\\ ".join(" & ".join(str(x) for x in row) for row in rows)
    return f"\\begin{{pmatrix}} {body} \\end{{pmatrix}}"


def near_identity_powers(rng: random.Random, words: int, n: int = 12) -> str:
    """A = I + E (a 1 above the diagonal in the first row): A^k written out in full, each."""
    parts = [f"Let A be the {n}x{n} matrix with ones on the diagonal and a 1 in position (1,2)."]
    k = 1
    while _words(parts) < words:
        rows = [[int(i == j) for j in range(n)] for i in range(n)]
        rows[0][1] = k
        parts.append(f"Then $A^{{{k}}} = {_pmatrix(rows)}$.")
        if rng.random() < 0.3:
            parts.append(rng.choice(PROSE))
        k += 1
    return "\n\n".join(parts)


def identity_matrices(rng: random.Random, words: int) -> str:
    """Identity matrices of growing size, each written in full, in LaTeX."""
    parts = ["The identity matrices, written out so we can see the structure:"]
    n = 4
    while _words(parts) < words:
        identity = _pmatrix([[int(i == j) for j in range(n)] for i in range(n)])
        parts.append(f"$I_{{{n}}} = {identity}$")
        parts.append(rng.choice(PROSE))
        n += 1
    return "\n\n".join(parts)


def sparse_and_tridiagonal(rng: random.Random, words: int) -> str:
    """Tridiagonal matrices (2 on the diagonal, -1 beside it) and sparse ones with a few nonzero
    entries, written out in full while eliminating."""
    parts = ["Consider the tridiagonal matrix T_n with 2 on the diagonal and -1 next to it."]
    n, step = 10, 0
    while _words(parts) < words:
        rows = [[2 if i == j else -1 if abs(i - j) == 1 else 0 for j in range(n)] for i in range(n)]
        for r in range(1, min(step % n + 1, n)):  # rows eliminated so far: pivots (r+1)/r
            rows[r][r - 1] = 0
            rows[r][r] = Fraction(r + 1, r)  # type: ignore[call-overload]
        parts.append(f"After {step} elimination steps: $T = {_pmatrix(rows)}$.")
        sparse = [[0] * n for _ in range(n)]
        for _ in range(3):
            sparse[rng.randrange(n)][rng.randrange(n)] = rng.randint(1, 9)
        parts.append(f"And the sparse update is $S_{{{step}}} = {_pmatrix(sparse)}$.")
        step += 1
    return "\n\n".join(parts)


def case_table(rng: random.Random, words: int) -> str:
    """n = k: 2^k mod 7 and whether 7 divides 2^(3k) - 1, for k = 1, 2, 3, ..."""
    parts = ["Let me tabulate 2^k mod 7 and check the claim case by case."]
    k = 1
    while _words(parts) < words:
        parts.append(f"n = {k}: 2^{k} mod 7 = {pow(2, k, 7)}, 2^{3 * k} - 1 mod 7 = 0, holds.")
        k += 1
    return "\n".join(parts)


def equal_term_sums(rng: random.Random, words: int) -> str:
    """Sums written term by term: 300 ones, 250 twos, products of many equal factors, ..."""
    parts = ["Let me just add them up one by one to be sure."]
    while _words(parts) < words:
        term, count = rng.choice(["1", "2", "\\frac{1}{2}", "3"]), rng.randint(100, 400)
        parts.append(f"$S = {' + '.join([term] * count)}$, that's {count} terms.")
        product = " \\cdot ".join(["2"] * rng.randint(40, 100))
        parts.append(f"$P = {product}$")
        parts.append(rng.choice(PROSE))
    return "\n\n".join(parts)


def reverification(rng: random.Random, words: int) -> str:
    """A formula re-checked for n = 1, 2, 3, ... with the same few phrasings (Phi-4-mini's
    habit): sum of the first n odd numbers is n^2."""
    parts = ["So the formula should be that the sum of the first n odd numbers is n^2."]
    phrasings = (
        "Let me check for n = {n}. The sum is {s}, and n^2 is {q}. So it holds for n = {n}.",
        "Wait, let me verify n = {n} again. 1 + ... + {o} = {s}, and {n}^2 = {q}. Yes.",
        "For n = {n}: the left side is {s}, the right side is {q}. Correct.",
    )
    n = 1
    while _words(parts) < words:
        parts.append(rng.choice(phrasings).format(n=n, s=n * n, q=n * n, o=2 * n - 1))
        if rng.random() < 0.1:
            parts.append("Hmm, so the formula holds so far. Let me keep checking to be safe.")
        n += 1
    return " ".join(parts)


def enumeration(rng: random.Random, words: int) -> str:
    """Listing the pairs (a, b) with a + b = N, and the subsets of a set, one by one."""
    parts = ["Let me enumerate all the possibilities."]
    total = 200
    while _words(parts) < words:
        parts.append(", ".join(f"({a}, {total - a})" for a in range(1, total)) + ".")
        parts.append(f"That's {total - 1} pairs with sum {total}.")
        items = "abcdefg"
        subsets = [
            "{" + ", ".join(x for i, x in enumerate(items) if mask >> i & 1) + "}"
            for mask in range(1 << len(items))
        ]
        parts.append("The subsets are " + ", ".join(subsets) + ".")
        total += 1
    return "\n\n".join(parts)


def decimal_expansions(rng: random.Random, words: int) -> str:
    """1/3, 1/7, 1/13, ... to hundreds of digits, in one run and grouped in threes."""
    parts = ["Let me compute the decimal expansions to many digits."]
    q = 3
    while _words(parts) < words:
        digits = str(10**600 // q).rjust(600, "0")
        grouped = " ".join(digits[j : j + 3] for j in range(0, 600, 3))
        parts.append(f"1/{q} = 0.{digits}...")
        parts.append(f"Grouped: 1/{q} = 0.{grouped} ...")
        q += 2 if q % 10 != 3 else 4  # odd, never a multiple of 5
    return "\n\n".join(parts)


def digit_cycles(rng: random.Random, words: int) -> str:
    """The last digits of 2^n, 3^n, 7^n listed for 300 terms each."""
    parts = []
    base = 2
    while _words(parts) < words:
        digits = ", ".join(str(pow(base, n, 10)) for n in range(1, 301))
        parts.append(f"The units digits of {base}^n for n = 1 to 300: {digits}.")
        parts.append("So the cycle repeats as expected.")
        base += 1
    return "\n\n".join(parts)


def truth_tables(rng: random.Random, words: int) -> str:
    """Truth tables of formulas in 4 and 5 variables, every row."""
    parts = []
    formula = 0
    while _words(parts) < words:
        names = "pqrst"[: 4 + formula % 2]
        parts.append(f"Truth table {formula + 1} over {', '.join(names)}:")
        for mask in range(1 << len(names)):
            values = [(mask >> (len(names) - 1 - i)) & 1 for i in range(len(names))]
            result = (sum(values) + formula) % 2 == 0 or (values[0] and values[-1])
            cells = " | ".join("T" if v else "F" for v in values)
            parts.append(f"| {cells} | {'T' if result else 'F'} |")
        formula += 1
    return "\n".join(parts)


def long_multiplication(rng: random.Random, words: int) -> str:
    """Two 20-digit numbers multiplied digit by digit, partial products written out."""
    parts = []
    while _words(parts) < words:
        a, b = rng.randrange(10**19, 10**20), rng.randrange(10**19, 10**20)
        parts.append(f"Let me multiply {a} by {b} by hand.")
        total = 0
        for place, digit in enumerate(reversed(str(b))):
            partial = a * int(digit) * 10**place
            total += partial
            parts.append(f"{a} x {digit} x 10^{place} = {partial}, running total {total}.")
        parts.append(f"So {a} x {b} = {total}.")
    return "\n".join(parts)


PROGRESSING: dict[str, Callable[[random.Random, int], str]] = {
    "near-identity powers": near_identity_powers,
    "identity matrices": identity_matrices,
    "sparse and tridiagonal": sparse_and_tridiagonal,
    "case table": case_table,
    "equal-term sums": equal_term_sums,
    "re-verification": reverification,
    "enumeration": enumeration,
    "decimal expansions": decimal_expansions,
    "digit cycles": digit_cycles,
    "truth tables": truth_tables,
    "long multiplication": long_multiplication,
}

# Words that a near-verbatim loop swaps among from one copy to the next.
VARIANTS = {
    "So": ("Thus", "Therefore", "Hence"),
    "Wait,": ("Hmm,", "But", "Wait, no,"),
    "check": ("verify", "double-check", "confirm"),
    "is": ("equals", "gives"),
    "the": ("this", "that"),
}


def paragraph_loop(
    rng: random.Random, before: int, period: int, words: int, varied: float = 0.0
) -> tuple[str, int]:
    """A normal trace of ``before`` words, then a paragraph of about ``period`` words repeated
    until ``words`` words in all; with ``varied``, each word that has variants (VARIANTS) is
    swapped for one of them with that chance, each time round. Return the text and the word at
    which the loop's first copy begins."""
    head = normal_trace(rng, before).split() if before else []
    span = normal_trace(rng, period).split()[:period]
    text = list(head)
    while len(text) < words:
        for word in span:
            choices = VARIANTS.get(word)
            text.append(rng.choice(choices) if choices and rng.random() < varied else word)
    return " ".join(text[:words]), len(head)
