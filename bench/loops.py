"""The loop rule's two error kinds: false positives and how soon loops are caught.

    python bench/loops.py [--traces 200] [--seed 1] [--rule FILE --out DIR]

On three sets, each text fed in pieces of 1 to 12 characters as a stream cuts them:

- the real-trace corpus (``tests/data/real_traces``, hand-labelled): per split — the rule's
  numbers were chosen on *dev*; *test* is reported, not tuned on — false positives among the
  traces that do not loop, and for each loop the characters between where it began and where
  it was caught;
- the progressing shapes of ``tests/shapes.py`` (matrices, case tables, sums term by term, ...)
  at 2,000 to 9,000 words, and long synthetic traces (``tests/traces.py``): false positives;
- the enumerations of ``tests/enumerations.py`` (residue tables, gcd pairs, coin flips, truth
  tables in words, ...) at 2,000 to 9,000 words, its *dev* set (tuned on) and its *hold-out*
  set (never tuned on) apart: false positives;
- synthetic loops, 6,000 words of each (or 15 copies): a paragraph written again and again,
  verbatim or with 10% or 30% of its words that have variants swapped for one each time round
  (``paragraph_loop``), and a span repeated with random characters appended to some of its
  words each time round (``looping_trace``), which makes up new words each copy.

Writes bench/results/loops.json and .md. ``--rule`` measures another version of the rule
(``git show 5811e55:phi4cli/text/loops.py > /tmp/old.py``) on the same texts, written to
``--out`` instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phi4cli.text import loops  # noqa: E402
from tests.enumerations import DEV, HOLD_OUT  # noqa: E402
from tests.shapes import PROGRESSING, paragraph_loop  # noqa: E402
from tests.traces import looping_trace, normal_trace  # noqa: E402

CORPUS = ROOT / "tests" / "data" / "real_traces" / "traces.jsonl"
RULE = (
    "NGRAM",
    "SEQUENCE",
    "SHORT_SEQUENCE",
    "COPIES",
    "MIN_SPAN",
    "SHARE",
    "NEW_PER_COPY",
    "MIN_DISTINCT",
    "LONG_SPAN",
    "LONG_CHARS",
    "LOOKBACK",
    "ALIGNED",
    "NEAR_DISTINCT",
    "CHANGED",
    "NEAR_LOOKBACK",
)


def detect(text: str, rng: random.Random) -> tuple[int | None, int | None, int]:
    """(the word, the character) at which ``text`` is flagged, or Nones; and its words."""
    detector = loops.LoopDetector()
    at = 0
    while at < len(text):
        size = rng.randint(1, 12)
        if detector.feed(text[at : at + size]):
            return detector.looped_at, at + size, detector.words
        at += size
    detector.finish()
    return detector.looped_at, None, detector.words


def real(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    rows = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    result: dict[str, Any] = {}
    for split in ("dev", "test"):
        mine = [r for r in rows if r["split"] == split]
        clean = [r for r in mine if not r["loop"]]
        flagged = [r["id"] for r in clean if detect(r["thinking"], rng)[1] is not None]
        caught = []
        for row in (r for r in mine if r["loop"]):
            _, char, _ = detect(row["thinking"], rng)
            caught.append(
                {
                    "id": row["id"],
                    "model": row["model"],
                    "kind": row["loop_kind"],
                    "period_chars": row["period_chars"],
                    "chars_after_start": None if char is None else char - row["loop_start_char"],
                }
            )
        result[split] = {"no_loop": len(clean), "false_positives": flagged, "loops": caught}
    return result


def shapes(seed: int, traces: int) -> dict[str, Any]:
    texts, rng = random.Random(seed), random.Random(seed + 1)  # the same texts, whatever the rule
    flagged: dict[str, int] = {}
    words = 0
    for name, shape in PROGRESSING.items():
        flagged[name] = 0
        for seed in range(traces // 40 + 1):
            text = shape(random.Random(seed), texts.choice((2000, 4000, 9000)))
            at, _, count = detect(text, rng)
            flagged[name] += at is not None
            words += count
    normal, normal_words = 0, 0
    started = time.perf_counter()
    for _ in range(traces):
        at, _, count = detect(normal_trace(texts, texts.randint(2000, 8000)), rng)
        normal += at is not None
        normal_words += count
    per_word_us = (time.perf_counter() - started) / max(1, normal_words) * 1e6
    return {
        "shapes": flagged,
        "shape_texts": len(PROGRESSING) * (traces // 40 + 1),
        "shape_words": words,
        "normal_traces": traces,
        "normal_words": normal_words,
        "normal_false_positives": normal,
        "us_per_word": round(per_word_us, 2),
    }


def enumerations(seed: int, traces: int) -> dict[str, Any]:
    rng = random.Random(seed)
    result: dict[str, Any] = {}
    for split, family in (("dev", DEV), ("hold-out", HOLD_OUT)):
        flagged: dict[str, list[int]] = {}
        texts = words = 0
        for name, shape in family.items():
            flagged[name] = []
            for seed in range(traces // 40 + 1):
                text = shape(random.Random(seed), (2000, 4000, 9000)[seed % 3])
                at, _, count = detect(text, rng)
                if at is not None:
                    flagged[name].append(at)
                texts += 1
                words += count
        result[split] = {
            "shapes": len(family),
            "texts": texts,
            "words": words,
            "flagged": {k: v for k, v in flagged.items() if v},
        }
    return result


def synthetic(seed: int, count: int) -> dict[str, Any]:
    texts, rng = random.Random(seed), random.Random(seed + 1)  # the same texts, whatever the rule
    rows: dict[str, Any] = {}

    def measure(name: str, period: int, make: Any) -> None:
        after = []
        for _ in range(count):
            text, head = make()
            at, _, _ = detect(text, rng)
            if at is not None and at > head:
                after.append(at - head)
        soon = (loops.COPIES + 2) * period + 40  # as tests/test_loop_rule.py asks of most
        rows[name] = {
            "traces": count,
            "caught": len(after),
            "caught_within_copies_plus_2": sum(words <= soon for words in after),
            "median_words_after_start": statistics.median(after) if after else None,
            "max_words_after_start": max(after) if after else None,
        }

    for period in (5, 30, 60, 120, 400):
        for varied in (0.0, 0.1, 0.3):
            before = texts.randint(0, 3000)
            measure(
                f"paragraph of {period} words, {varied:.0%} of words swapped for variants",
                period,
                lambda p=period, v=varied, b=before: paragraph_loop(
                    texts, b, p, b + max(6000, 15 * p), v
                ),
            )
    for period in (20, 60, 150):
        for mutate in (0.02, 0.05):
            before = texts.randint(0, 2000)
            measure(
                f"span of {period} words, {mutate:.0%} of words made new each time",
                period,
                lambda p=period, m=mutate, b=before: looping_trace(
                    texts, b, p, b + max(6000, 15 * p), m
                ),
            )
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Rule: {result['rule']}",
        "",
        "Real traces (tests/data/real_traces):",
        "",
        "| split | no-loop traces | false positives | loops caught | characters from "
        "its start to the catch, each |",
        "| --- | --- | --- | --- | --- |",
    ]
    for split, row in result["real"].items():
        caught = [x for x in row["loops"] if x["chars_after_start"] is not None]
        each = ", ".join(
            f"{x['id']} {x['chars_after_start']:,}"
            if x["chars_after_start"] is not None
            else f"{x['id']} missed"
            for x in row["loops"]
        )
        lines.append(
            f"| {split} | {row['no_loop']} | {len(row['false_positives'])} | "
            f"{len(caught)}/{len(row['loops'])} | {each} |"
        )
    s = result["progress"]
    lines += [
        "",
        f"Progressing shapes: {s['shape_texts']} texts ({s['shape_words']:,} words), "
        f"flagged: {sum(s['shapes'].values())} ({s['shapes']}).",
        "",
    ]
    for split, row in result["enumerations"].items():
        flagged = sum(len(v) for v in row["flagged"].values())
        lines.append(
            f"Enumerations, {split}: {row['shapes']} shapes, {row['texts']} texts "
            f"({row['words']:,} words), flagged: {flagged}"
            + (f" {row['flagged']}" if flagged else "")
            + "."
        )
    lines += [
        "",
        f"Synthetic long traces: {s['normal_traces']} ({s['normal_words']:,} words), "
        f"false positives: {s['normal_false_positives']}; {s['us_per_word']} µs per word.",
        "",
        "| synthetic loop | caught | within COPIES + 2 periods (and 40 words) | "
        "median words after its start | most |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in result["synthetic"].items():
        lines.append(
            f"| {name} | {row['caught']}/{row['traces']} | {row['caught_within_copies_plus_2']} | "
            f"{row['median_words_after_start']} | {row['max_words_after_start']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rule", type=Path, help="another loops.py to measure")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    if args.rule:
        global loops
        spec = importlib.util.spec_from_file_location("rule", args.rule)
        assert spec and spec.loader
        loops = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loops)
    result = {
        "rule": {name.lower(): getattr(loops, name) for name in RULE if hasattr(loops, name)},
        "real": real(args.seed),
        "progress": shapes(args.seed, args.traces),
        "enumerations": enumerations(args.seed, args.traces),
        "synthetic": synthetic(args.seed, max(5, args.traces // 10)),
    }
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "loops.json").write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    text = markdown(result)
    (out / "loops.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
