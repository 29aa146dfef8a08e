"""The loop detector's false positives and how soon it catches loops, on synthetic traces.

    python bench/loops.py [--traces 1000] [--seed 1]

Traces in Phi-4-mini-reasoning's style (``tests/traces.py``): long ones that do not loop
(2,000-8,000 words of steps, formulas from the notation corpus, stock phrases and steps
restated word for word), and ones that fall into a loop after a normal start, with periods from
5 to 400 words, repeated exactly or with 2% or 5% of their words changed each time round.
For each: whether ``phi4cli.loops.LoopDetector`` flags it, and for a loop how many words after
its start (and how many times round) it is caught. A word is about 1.5 tokens of
Phi-4-mini's tokenizer in such text.

Writes bench/results/loops.json and .md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phi4cli.loops import NGRAM, SEEN_BEFORE, SHARE, WINDOW, LoopDetector  # noqa: E402
from tests.traces import looping_trace, normal_trace  # noqa: E402

PERIODS = (5, 20, 60, 150, 400)
MUTATIONS = (0.0, 0.02, 0.05)


def detect(text: str, chunk: int) -> tuple[int | None, int]:
    """Where the detector flags ``text`` fed in pieces of ``chunk`` characters (as streamed)."""
    detector = LoopDetector()
    for start in range(0, len(text), chunk):
        if detector.feed(text[start : start + chunk]):
            break
    detector.finish()
    return detector.looped_at, detector.words


def run(traces: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    false_positives, normal_words = 0, 0
    started = time.perf_counter()
    for _ in range(traces):
        text = normal_trace(rng, rng.randint(2000, 8000))
        at, words = detect(text, rng.randint(1, 12))
        normal_words += words
        false_positives += at is not None
    per_word_us = (time.perf_counter() - started) / max(1, normal_words) * 1e6
    loops: dict[str, dict[str, Any]] = {}
    for period in PERIODS:
        for mutate in MUTATIONS:
            caught, after = 0, []
            count = max(1, traces // 10)
            for _ in range(count):
                before = rng.randint(0, 2000)
                text, head = looping_trace(rng, before, period, head_room(before, period), mutate)
                at, _ = detect(text, rng.randint(1, 12))
                if at is not None and at > head:
                    caught += 1
                    after.append(at - head)
            loops[f"period {period}, {mutate:.0%} changed"] = {
                "traces": count, "caught": caught,
                "median_words_after_start": statistics.median(after) if after else None,
                "max_words_after_start": max(after) if after else None,
                "median_times_round": round(statistics.median(after) / period, 1)
                if after else None,
            }  # fmt: skip
    return {
        "rule": {"ngram": NGRAM, "seen_before": SEEN_BEFORE, "window": WINDOW, "share": SHARE},
        "normal": {
            "traces": traces,
            "words": normal_words,
            "false_positives": false_positives,
            "us_per_word": round(per_word_us, 2),
        },
        "loops": loops,
    }


def head_room(before: int, period: int) -> int:
    """Words in all: the start, and the loop for long enough to be caught (or not)."""
    return before + max(3000, 12 * period)


def markdown(result: dict[str, Any]) -> str:
    normal = result["normal"]
    lines = [
        f"Rule: {result['rule']}",
        "",
        f"Non-looping traces: {normal['traces']} ({normal['words']:,} words), "
        f"false positives: {normal['false_positives']}; {normal['us_per_word']} µs per word.",
        "",
        "| loop | caught | median words after its start | most | median times round |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in result["loops"].items():
        lines.append(f"| {name} | {row['caught']}/{row['traces']} | "
                     f"{row['median_words_after_start']} | {row['max_words_after_start']} | "
                     f"{row['median_times_round']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    result = run(args.traces, args.seed)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "loops.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (out / "loops.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
