"""Enumerations a reasoning model writes out in full: every row new, every word in it seen before.

A table of x^2 + y^2 mod 7 over all 49 pairs, gcd of every pair, every sequence of coin flips,
a truth table in words — each row reuses the words of the rows before it in a new order, so a
rule that counts new *words* reads it as a loop. These are progress and must run to the end.

Two sets, written before the loop rule was tuned on either:

- ``DEV``: the shapes the rule's numbers were chosen on — residue and multiplication tables,
  gcd pairs, coin and dice sequences, truth tables in words and in symbols (T/F, 0/1), last-digit
  cycles, small searches;
- ``HOLD_OUT``: never tuned on, only reported — other families (divisor lists, binomial
  coefficients, permutations, lattice points, binary expansions, Fibonacci mod m, quadratic
  residues) and other phrasings of the dev families (the residue table, the truth table in words,
  coin flips and a search, each in words a second generator chose).

Each generator writes at least ``words`` words (whitespace-separated), deterministically for a
seed, in the wording of a reasoning model's thinking: a plan, rows, a remark now and then, a
summary of each table, then the next table (the next modulus, the next length, ...).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from math import comb, gcd
from typing import Any

Shape = Callable[[random.Random, int], str]

REMARKS = (
    "Hmm, let me keep going.",
    "Okay, next one.",
    "Let me double-check that one. Yes, that's right.",
    "So far so good.",
    "Wait, let me make sure I'm not skipping any.",
    "Okay, continuing.",
)


class _Text:
    """Parts of a text and their words so far."""

    def __init__(self, rng: random.Random, first: str) -> None:
        self.rng = rng
        self.parts = [first]
        self.words = len(first.split())

    def add(self, part: str) -> None:
        self.parts.append(part)
        self.words += len(part.split())

    def remark(self, chance: float = 0.08, remarks: tuple[str, ...] = REMARKS) -> None:
        if self.rng.random() < chance:
            self.add(self.rng.choice(remarks))

    def text(self, sep: str = "\n") -> str:
        return sep.join(self.parts)


def _fresh(rng: random.Random, used: set[object], draw: Callable[[], Any]) -> Any:
    """A draw not drawn before (a model that writes the same table twice repeats itself)."""
    for _ in range(10_000):
        if (choice := draw()) not in used:
            used.add(choice)
            return choice
    raise ValueError("no new table left to draw")


# --- dev ------------------------------------------------------------------------------------------


def residue_table(rng: random.Random, words: int) -> str:
    """A form in x, y mod m over all m^2 pairs ("x = 3, y = 5: 9 + 25 = 34 ≡ 6 (mod 7)"), for
    several forms and small moduli; every other table reduces each term first and says so in
    words, so that after a few rows no word in it is new."""
    out = _Text(rng, "Okay, so I need to find all pairs (x, y) with the form ≡ 0 (mod m).")
    forms = (("x^2 + y^2", 1, 1), ("x^2 + 2y^2", 1, 2), ("x^2 - y^2", 1, -1), ("3x^2 + y^2", 3, 1))
    for round_ in itertools.count():
        (name, a, b), m = forms[round_ % len(forms)], (7, 5, 11, 13)[round_ // 4 % 4]
        reduced = round_ % 2 == 1
        out.add(f"Let me just go through all {m * m} pairs for {name} mod {m}.")
        hits = []
        for x, y in itertools.product(range(m), repeat=2):
            u, v = a * x * x, b * y * y
            r = (u + v) % m
            if reduced:
                verdict = "this pair works" if r == 0 else "this pair does not work"
                out.add(
                    f"For x = {x} and y = {y}, the first term is {u % m} mod {m} and the second "
                    f"is {v % m} mod {m}, so when we add them up the sum is {r} mod {m}, "
                    f"which means {verdict}."
                )
            else:
                out.add(f"x = {x}, y = {y}: {u} + {v} = {u + v} ≡ {r} (mod {m}).")
            if r == 0:
                hits.append(f"({x}, {y})")
                out.add("That one works.")
            out.remark(0.04)
        out.add(f"So for {name} mod {m} the pairs that work are {', '.join(hits)}.")
        if out.words >= words:
            break
    return out.text()


def multiplication_table(rng: random.Random, words: int) -> str:
    """a times b mod m for every pair, to find the inverses, for m = 7, 11, 13, ..."""
    out = _Text(rng, "Let me write out the multiplication table to find each inverse.")
    for m in itertools.cycle((7, 8, 9, 10, 11, 12, 13)):
        out.add(f"Mod {m}:")
        for a in range(1, m):
            for b in range(1, m):
                out.add(f"{a} times {b} is {a * b}, which is {a * b % m} mod {m}.")
                if a * b % m == 1:
                    out.add(f"So the inverse of {a} is {b}.")
            out.remark(0.3)
        if out.words >= words:
            break
    return out.text()


def _euclid(a: int, b: int) -> list[str]:
    steps = []
    while a:
        steps.append(f"{b} = {b // a}·{a} + {b % a}")
        a, b = b % a, a
    return steps


def gcd_pairs(rng: random.Random, words: int) -> str:
    """gcd(a, b) by Euclid's steps for every pair 1 <= a < b <= N, counting the coprime ones,
    N = 10, 12, 14, ...: no number above N, so new words are few."""
    out = _Text(rng, "I need to count the coprime pairs. Let me do each pair by Euclid.")
    n = 10
    while out.words < words:
        count = 0
        out.add(f"Pairs with 1 ≤ a < b ≤ {n}:")
        for a in range(1, n + 1):
            for b in range(a + 1, n + 1):
                g = gcd(a, b)
                count += g == 1
                verdict = "coprime" if g == 1 else "not coprime"
                out.add(f"({a}, {b}): {', '.join(_euclid(a, b))}, so gcd = {g}, {verdict}.")
            out.remark(0.2)
        out.add(f"So there are {count} coprime pairs up to {n}.")
        n += 2
    return out.text()


def coin_sequences(rng: random.Random, words: int) -> str:
    """Every sequence of n coin flips, whether it has two heads in a row, n = 4, 5, 6, ..."""
    out = _Text(rng, "Let me list all the sequences and check each one for HH.")
    n = 4
    while out.words < words:
        out.add(f"For {n} flips there are {2**n} sequences:")
        good = 0
        for flips in itertools.product("HT", repeat=n):
            seq = ("" if n % 2 else " ").join(flips)
            if "HH" in "".join(flips):
                out.add(f"{seq}: has HH, no.")
            else:
                good += 1
                out.add(f"{seq}: no HH, yes.")
            out.remark(0.03)
        out.add(f"So {good} of the {2**n} sequences have no two heads in a row.")
        n += 1
    return out.text()


def dice_sequences(rng: random.Random, words: int) -> str:
    """Every roll of three dice, its sum, whether it is the target; then the next target."""
    out = _Text(rng, "Let me enumerate all the outcomes of three dice and check the sum.")
    target = 10
    while out.words < words:
        out.add(f"Looking for a sum of {target}:")
        count = 0
        for roll in itertools.product(range(1, 7), repeat=3):
            total = sum(roll)
            hit = total == target
            count += hit
            out.add(f"({roll[0]}, {roll[1]}, {roll[2]}): sum {total}, {'yes' if hit else 'no'}.")
            out.remark(0.02)
        out.add(f"So {count} outcomes out of 216 give {target}.")
        target += 1
    return out.text()


_CONNECTIVES: tuple[tuple[str, Callable[[bool, bool], bool]], ...] = (
    ("and", lambda a, b: a and b),
    ("or", lambda a, b: a or b),
    ("implies", lambda a, b: (not a) or b),
    ("xor", lambda a, b: a != b),
)


def _tf(value: bool) -> str:
    return "true" if value else "false"


def truth_table_words(rng: random.Random, words: int) -> str:
    """Truth tables written in sentences: 'If p is true and q is false, then p and q is false';
    each table checks its own choice of connectives."""
    out = _Text(rng, "Let me write out the truth table in words to be careful.")
    names = "pqrs"
    used: set[object] = set()
    round_ = 0
    while out.words < words:
        count = 3 + round_ % 2
        pairs = list(itertools.combinations(range(count), 2))
        chosen = _fresh(
            rng, used, lambda pairs=pairs: tuple(rng.choice(_CONNECTIVES) for _ in pairs)
        )
        out.add(f"Now with {count} variables, {', '.join(names[:count])}:")
        for values in itertools.product((True, False), repeat=count):
            given = " and ".join(f"{n} is {_tf(v)}" for n, v in zip(names, values, strict=False))
            claims = [
                f"{names[i]} {word} {names[j]} is {_tf(op(values[i], values[j]))}"
                for (word, op), (i, j) in zip(chosen, pairs, strict=True)
            ]
            out.add(f"If {given}, then {', '.join(claims)}.")
            out.remark(0.05)
        round_ += 1
    return out.text()


def truth_table_symbols(rng: random.Random, words: int) -> str:
    """Truth tables in symbols: rows of T/F in a table, and rows of 0/1, for many formulas (each
    table's value column is a formula of its own: a sum of products of its variables, mod 2)."""
    out = _Text(rng, "Let me just do the full truth table.")
    formulas = tuple(  # ("v" is LOGICAL OR)
        f.replace("v", "\N{LOGICAL OR}")
        for f in ("(p ∧ q) → r", "p ⊕ q ⊕ r", "(p v ¬q) ∧ (q v r)", "¬(p ∧ r) v q", "p → (q → r)")
    )
    used: set[object] = set()
    round_ = 0
    while out.words < words:
        count = 3 + round_ % 3
        names = "pqrst"[:count]
        rows = list(itertools.product((1, 0), repeat=count))

        def column(
            count: int = count, rows: list[tuple[int, ...]] = rows, parity: int = round_ % 2
        ) -> tuple[object, ...]:
            terms = [rng.sample(range(count), rng.randint(1, 2)) for _ in range(3)]
            values = (sum(all(row[i] for i in term) for term in terms) % 2 for row in rows)
            return (count, parity, *values)

        value_column = _fresh(rng, used, column)[2:]
        symbols = ("T", "F") if round_ % 2 == 0 else ("1", "0")
        out.add(f"Table for {formulas[round_ % len(formulas)]} with {count} variables:")
        out.add("| " + " | ".join(names) + " | value |")
        for values, value in zip(rows, value_column, strict=True):
            cells = " | ".join(symbols[1 - v] for v in values)
            out.add(f"| {cells} | {symbols[0 if value else 1]} |")
        out.add(f"So that formula is {'satisfiable' if round_ % 4 else 'not a tautology'}.")
        round_ += 1
    return out.text()


def last_digit_cycles(rng: random.Random, words: int) -> str:
    """The last digit of b^k for k = 1, 2, ..., 24 and b = 2, 3, 4, ...: '7^2 ends in 9'."""
    out = _Text(rng, "Let me look at the last digits of the powers and find each cycle.")
    base = 2
    while out.words < words:
        out.add(f"Powers of {base}:")
        row = [f"{base}^{k} ends in {pow(base, k, 10)}" for k in range(1, 25)]
        out.add(", ".join(row) + ".")
        seen: list[int] = []
        for k in range(1, 25):
            digit = pow(base, k, 10)
            if digit in seen:
                break
            seen.append(digit)
        out.add(f"So the cycle for {base} is {', '.join(map(str, seen))}, of length {len(seen)}.")
        out.remark(0.3)
        base += 1
    return out.text()


def small_search(rng: random.Random, words: int) -> str:
    """Solving a·x + b ≡ c (mod m) by trying x = 0, 1, 2, ... for many (a, b, c) and small m:
    "Try x = 4: 3 times 4 plus 2 is 14, which is 3 mod 11. Not 7."."""
    out = _Text(rng, "I don't see a clever way, so let me just try values of x.")
    for round_ in itertools.count():
        m = (11, 13, 7)[round_ % 3]
        a, b, c = 2 + round_ % (m - 2), round_ * 5 % m, round_ * 3 % m
        out.add(f"We want {a}x + {b} ≡ {c} (mod {m}).")
        for x in range(m):
            value = a * x + b
            if value % m == c:
                out.add(
                    f"Try x = {x}: {a} times {x} plus {b} is {value}, which is {c} mod {m}. Yes!"
                )
                break
            out.add(
                f"Try x = {x}: {a} times {x} plus {b} is {value}, which is {value % m} mod {m}. "
                f"Not {c}."
            )
            out.remark(0.03)
        if out.words >= words:
            break
    return out.text()


DEV: dict[str, Shape] = {
    "residue table": residue_table,
    "multiplication table": multiplication_table,
    "gcd pairs": gcd_pairs,
    "coin sequences": coin_sequences,
    "dice sequences": dice_sequences,
    "truth table in words": truth_table_words,
    "truth table in symbols": truth_table_symbols,
    "last-digit cycles": last_digit_cycles,
    "small search": small_search,
}


# --- hold-out -------------------------------------------------------------------------------------

ASIDES = (
    "Alright.",
    "Hmm, okay.",
    "That matches what I expected.",
    "Let me slow down a bit here.",
    "Good, moving on.",
)


def residue_pairs_spoken(rng: random.Random, words: int) -> str:
    """The residue table of the dev set in other words: 'Pair (3, 5): 3 squared is 9, ...', for
    small moduli, then the same moduli again for x squared plus twice y squared."""
    out = _Text(rng, "Okay, let's brute-force this over every pair of residues.")
    for round_ in itertools.count():
        m, twice = (5, 7, 9, 11)[round_ % 4], round_ // 4 % 2 == 1
        out.add(f"Working modulo {m} now{', with twice the second square' if twice else ''}.")
        for x, y in itertools.product(range(m), repeat=2):
            s = x * x + (2 if twice else 1) * y * y
            second = f"twice {y} squared is {2 * y * y}" if twice else f"{y} squared is {y * y}"
            out.add(
                f"Pair ({x}, {y}): {x} squared is {x * x}, {second}, total {s}; "
                f"{s} divided by {m} leaves remainder {s % m}."
            )
            out.remark(0.03, ASIDES)
        if out.words >= words:
            break
    return out.text(" ")


def truth_cases_spoken(rng: random.Random, words: int) -> str:
    """Truth tables as cases: 'Case p = T, q = F, r = T: p → q is F, ... so the whole is F.',
    each formula two implications between variables it picks."""
    out = _Text(rng, "I'll check every case of the truth values.")
    names = "pqrs"
    used: set[object] = set()
    round_ = 0
    while out.words < words:
        count = 3 + round_ % 2
        (a, b), (c, d), joined = _fresh(
            rng,
            used,
            lambda count=count: (
                *sorted((tuple(rng.sample(range(count), 2)), tuple(rng.sample(range(count), 2)))),
                rng.choice(("and", "or")),
            ),
        )
        out.add(f"Formula {round_ + 1}, in {count} variables.")
        for values in itertools.product("TF", repeat=count):
            v = [x == "T" for x in values]
            left, right = (not v[a]) or v[b], (not v[c]) or v[d]
            whole = (left and right) if joined == "and" else (left or right)
            assign = ", ".join(f"{n} = {x}" for n, x in zip(names, values, strict=False))
            out.add(
                f"Case {assign}: {names[a]} → {names[b]} is {'T' if left else 'F'}, "
                f"{names[c]} → {names[d]} is {'T' if right else 'F'}, "
                f"so the whole thing is {'T' if whole else 'F'}."
            )
            out.remark(0.04, ASIDES)
        round_ += 1
    return out.text(" ")


def coin_flips_spoken(rng: random.Random, words: int) -> str:
    """Coin flips in other words: 'T H H T has 2 heads and 2 tails, so it counts.'"""
    out = _Text(rng, "Let me enumerate the flip sequences explicitly, spaced out.")
    n = 3
    while out.words < words:
        out.add(f"With {n} flips, we need more heads than tails:")
        for flips in itertools.product("HT", repeat=n):
            heads = flips.count("H")
            verdict = "so it counts" if 2 * heads > n else "so it doesn't count"
            out.add(f"{' '.join(flips)} has {heads} heads and {n - heads} tails, {verdict}.")
            out.remark(0.03, ASIDES)
        n += 1
    return out.text(" ")


def orders_spoken(rng: random.Random, words: int) -> str:
    """A search in other words: the order of a mod p by multiplying until 1 comes back, 'times
    3 is 27, that's 5 mod 11', for each a and small primes p."""
    out = _Text(rng, "There's probably a smarter way but let me find each order by hand.")
    for round_ in itertools.count():
        p = (11, 13, 7, 17)[round_ % 4]
        a = 2 + round_ // 4 % (p - 2)
        out.add(f"Order of {a} mod {p}: start with {a}.")
        power, k = a, 1
        while power != 1:
            out.add(
                f"Times {a} is {power * a}, that's {power * a % p} mod {p}, so {a}^{k + 1} is "
                f"{power * a % p}."
            )
            power, k = power * a % p, k + 1
            out.remark(0.03, ASIDES)
        out.add(f"So the order of {a} mod {p} is {k}.")
        if out.words >= words:
            break
    return out.text(" ")


def divisor_lists(rng: random.Random, words: int) -> str:
    """The divisors of n for n = 2, 3, 4, ..., their sum, whether n is perfect or abundant."""
    out = _Text(rng, "Let me list the divisors of each number and add them up.")
    n = 2
    while out.words < words:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        total = sum(divisors) - n
        kind = "perfect" if total == n else "abundant" if total > n else "deficient"
        out.add(
            f"The divisors of {n} are {', '.join(map(str, divisors))}; the proper ones add up "
            f"to {total}, so {n} is {kind}."
        )
        out.remark(0.05, ASIDES)
        n += 1
    return out.text("\n")


def binomial_rows(rng: random.Random, words: int) -> str:
    """C(n, k) for every k of rows n = 6, 7, 8, ...: the value and whether it is even."""
    out = _Text(rng, "I'll compute each binomial coefficient and note its parity.")
    n = 6
    while out.words < words:
        for k in range(n + 1):
            value = comb(n, k)
            out.add(f"C({n}, {k}) = {value}, which is {'even' if value % 2 == 0 else 'odd'}.")
        odd = sum(comb(n, k) % 2 for k in range(n + 1))
        out.add(f"So row {n} has {odd} odd entries.")
        out.remark(0.2, ASIDES)
        n += 1
    return out.text("\n")


def permutations_fixed_points(rng: random.Random, words: int) -> str:
    """Every permutation of 1..n, its fixed points, whether it is a derangement; n = 4, 5."""
    out = _Text(rng, "Let me list all the permutations and count the fixed points directly.")
    n = 4
    while out.words < words:
        derangements = 0
        for perm in itertools.permutations(range(1, n + 1)):
            fixed = [i + 1 for i, x in enumerate(perm) if x == i + 1]
            shown = " ".join(map(str, perm))
            if fixed:
                out.add(f"{shown}: fixed points {', '.join(map(str, fixed))}, not a derangement.")
            else:
                derangements += 1
                out.add(f"{shown}: no fixed points, a derangement.")
            out.remark(0.02, ASIDES)
        out.add(f"That gives {derangements} derangements of {n} elements.")
        n += 1
    return out.text("\n")


def lattice_points(rng: random.Random, words: int) -> str:
    """Lattice points (a, b) with 0 <= a, b <= R: inside the circle of radius R or not."""
    out = _Text(rng, "Count the lattice points in the quarter disc by checking each one.")
    radius = 5
    while out.words < words:
        r2 = radius * radius
        out.add(f"Radius {radius}, so we compare with {r2}.")
        inside = 0
        for a, b in itertools.product(range(radius + 1), repeat=2):
            s = a * a + b * b
            where = "inside" if s < r2 else "on the circle" if s == r2 else "outside"
            inside += s <= r2
            out.add(f"({a}, {b}): {a * a} + {b * b} = {s}, {where}.")
        out.add(f"So {inside} points for radius {radius}.")
        out.remark(0.3, ASIDES)
        radius += 1
    return out.text("\n")


def binary_expansions(rng: random.Random, words: int) -> str:
    """n in binary for n = 1, 2, 3, ...: its digits, its ones, whether the count is odd."""
    out = _Text(rng, "Let me write each number in binary and count the ones.")
    n = 1
    while out.words < words:
        digits = format(n, "b")
        ones = digits.count("1")
        spaced = " ".join(digits)
        out.add(f"{n} = {spaced} in binary, {ones} ones, {'odd' if ones % 2 else 'even'}.")
        out.remark(0.03, ASIDES)
        n += 1
    return out.text("\n")


def fibonacci_mod(rng: random.Random, words: int) -> str:
    """Fibonacci numbers mod m for m = 7, 8, 9, ... until the pair 0, 1 comes back (Pisano)."""
    out = _Text(rng, "To get the Pisano period I'll just run the Fibonacci numbers mod m.")
    m = 7
    while out.words < words:
        out.add(f"Mod {m}:")
        a, b, k = 0, 1, 1
        while True:
            a, b = b, (a + b) % m
            k += 1
            out.add(f"F_{k} ≡ {a} + {b - a if b >= a else b - a + m} = {b}.")
            if (a, b) == (0, 1):
                break
        out.add(f"So the period mod {m} is {k - 1}.")
        out.remark(0.3, ASIDES)
        m += 1
    return out.text("\n")


def quadratic_residues(rng: random.Random, words: int) -> str:
    """Is a a square mod p? Squares of 1, 2, ... written out until a is found or ruled out."""
    out = _Text(rng, "Let me check which numbers are squares mod p by trying each root.")
    p = 11
    primes = (11, 13, 17, 19, 23, 29, 31, 37)
    index = 0
    while out.words < words:
        p = primes[index % len(primes)]
        a = 2 + index // len(primes)
        found = None
        steps = []
        for x in range(1, (p - 1) // 2 + 1):
            steps.append(f"{x}^2 = {x * x} ≡ {x * x % p}")
            if x * x % p == a % p:
                found = x
                break
        verdict = f"Yes, {found} works." if found else f"No, {a} is not a square mod {p}."
        out.add(f"Is {a} a square mod {p}? {'; '.join(steps)}. {verdict}")
        out.remark(0.05, ASIDES)
        index += 1
    return out.text(" ")


HOLD_OUT: dict[str, Shape] = {
    "residue pairs (spoken)": residue_pairs_spoken,
    "truth cases (spoken)": truth_cases_spoken,
    "coin flips (spoken)": coin_flips_spoken,
    "orders (spoken)": orders_spoken,
    "divisor lists": divisor_lists,
    "binomial rows": binomial_rows,
    "permutations": permutations_fixed_points,
    "lattice points": lattice_points,
    "binary expansions": binary_expansions,
    "Fibonacci mod m": fibonacci_mod,
    "quadratic residues": quadratic_residues,
}

ENUMERATIONS: dict[str, Shape] = {**DEV, **HOLD_OUT}
