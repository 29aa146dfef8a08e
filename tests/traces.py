"""Synthetic thinking traces in Phi-4-mini-reasoning's style, for the loop detector's tests and
``bench/loops.py``: long traces that do not loop (steps, formulas from the notation corpus,
checks that restate a step, the stock phrases a reasoning model says again and again) and
traces that fall into a loop (a span repeated to the end, exactly or with words changed)."""

from __future__ import annotations

import random
from pathlib import Path

NOTATION = [
    line.split("\t")[0]
    for line in (Path(__file__).parent / "data" / "notation.tsv").read_text().splitlines()[1:]
]

OPENINGS = (
    "Okay, so I need to solve this problem. Let me read it again carefully.",
    "Okay, let's see. I have to figure out what the question is asking first.",
    "Alright, let me try to work through this step by step.",
)
PHRASES = (
    "Wait, let me check that again.",
    "Hmm, that doesn't seem right.",
    "Let me think.",
    "So that part is fine.",
    "Wait, no.",
    "Let me verify this step.",
    "Hmm, maybe I made a mistake here.",
    "Alternatively, maybe there's a simpler way.",
    "Yes, that makes sense.",
    "Let me double-check the arithmetic.",
)
STEPS = (
    "If we substitute x = {a} into the expression we get {a} squared plus {b}, which is {c}.",
    "So the total is {a} times {b}, that's {c}, and then we add {d} to get {e}.",
    "Let me write that as {f} and see whether it simplifies.",
    "The equation becomes {f}, so we can divide both sides by {a}.",
    "Then {a} plus {b} equals {c}, and subtracting {d} leaves {e}.",
    "Now consider the case where n is {a}. Then the sum has {b} terms, and each is at most {c}.",
    "We know that {f}. Using this with the earlier result gives {g}.",
    "That means the remainder when {c} is divided by {a} is {d}.",
    "So the probability is {a} out of {c}, which reduces to {a}/{c}.",
    "Multiplying out, {f}, and comparing coefficients with {g} we get a = {a} and b = {b}.",
    "The area would be {a} times {b} divided by 2, so {c}.",
    "Check: {a} + {b} = {c}. Yes. And {c} - {d} = {e}.",
)


def _step(rng: random.Random) -> str:
    numbers = {name: rng.randint(2, 999) for name in "abcde"}
    formulas = {"f": f"${rng.choice(NOTATION)}$", "g": f"${rng.choice(NOTATION)}$"}
    return rng.choice(STEPS).format(**numbers, **formulas)


def normal_trace(rng: random.Random, words: int) -> str:
    """A long trace that never loops: steps and formulas, stock phrases, and checks that restate
    an earlier step word for word (once, or up to three times: a reasoning model re-verifies)."""
    parts = [rng.choice(OPENINGS)]
    done: list[str] = []
    count = len(parts[0].split())
    while count < words:
        roll = rng.random()
        if roll < 0.25:
            part = rng.choice(PHRASES)
        elif roll < 0.35 and done:
            part = "Let me redo that: " + rng.choice(done)  # a step restated, as written
        elif roll < 0.4:
            part = f"$$ {rng.choice(NOTATION)} $$"
        else:
            part = " ".join(_step(rng) for _ in range(rng.randint(1, 3)))
            done.append(part)
        parts.append(part)
        count += len(part.split())
    return "\n\n".join(parts) if rng.random() < 0.5 else " ".join(parts)


def looping_trace(
    rng: random.Random, before: int, period: int, words: int, mutate: float = 0.0
) -> tuple[str, int]:
    """A trace of ``before`` words, then a span of about ``period`` words repeated until
    ``words`` words in all, each word of each repeat changed with chance ``mutate``; with the
    number of words before the loop begins."""
    head = normal_trace(rng, before).split() if before else []
    span = normal_trace(rng, period).split()[:period]
    text = list(head)
    while len(text) < words:
        text += [f"{word}{rng.randint(0, 9)}" if rng.random() < mutate else word for word in span]
    return " ".join(text[:words]), len(head)
