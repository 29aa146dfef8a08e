"""Write bench/data/arithmetic-200.jsonl: 200 arithmetic word problems with their answers, for
real-sample votes with a small model (``phi4 eval ... -k 8 --all``, then ``bench/votes.py
replay``). One and two steps of + - x /, whole numbers; deterministic for the seed.

    python bench/make_arithmetic.py [--seed 7] [--count 200]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ("Tom", "Ana", "Li", "Sara", "Omar", "Mia", "Ravi", "Eva", "Ken", "Zoe")
THINGS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "cards")


def problem(rng: random.Random) -> tuple[str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b, c = rng.randint(2, 40), rng.randint(2, 30), rng.randint(2, 9)
    kind = rng.randrange(6)
    if kind == 0:
        return (
            f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have?",
            a + b,
        )
    if kind == 1:
        a += b
        return f"{name} had {a} {thing} and gave away {b}. How many {thing} are left?", a - b
    if kind == 2:
        return f"There are {c} boxes with {b} {thing} in each box. How many {thing} in all?", b * c
    if kind == 3:
        return (
            f"{name} shares {b * c} {thing} equally among {c} friends. How many {thing} "
            "does each friend get?",
            b,
        )
    if kind == 4:
        return (
            f"{name} buys {c} packs of {b} {thing} and then gets {a} more. How many {thing} "
            f"does {name} have now?",
            c * b + a,
        )
    a += b * c
    return (
        f"{name} had {a} {thing} and gave {c} friends {b} each. How many {thing} does "
        f"{name} have left?",
        a - b * c,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--count", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(rows) < args.count:
        text, answer = problem(rng)
        if text not in seen:
            seen.add(text)
            rows.append({"problem": text, "answer": str(answer)})
    out = Path(__file__).resolve().parent / "data" / f"arithmetic-{args.count}.jsonl"
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(out)


if __name__ == "__main__":
    main()
