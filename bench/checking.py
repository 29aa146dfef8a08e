"""The answer checker on public problems: how many answers it decides, and how many of its
verdicts are wrong (which must be none).

    python bench/checking.py [--split dev|holdout|both]

On the rows of MATH-500 and GSM8K kept in ``bench/data`` (their provenance and licences are in
``bench/data/README.md``), split by row number: even rows are *dev* (what the checker's rules were
written and corrected on), odd rows the *hold-out* (reported, never tuned on). For each problem
the checker (``phi4cli.text.checker.Checker``: its worker process, each check bounded to a
second, as ``phi4 solve`` runs it) is given:

- the dataset's reference answer, which is right: ``refuted`` is a wrong verdict;
- three wrong answers made from it — its first whole number plus one, its last whole number
  doubled (when not 0), and its negation (``-(...)``, when it is not 0) — ``verified`` is a
  wrong verdict. (A perturbation that leaves the value unchanged would make a ``verified``
  right; each wrong verdict is printed for a person to look at.)

Per subject: the share of reference answers decided (verified) and of wrong answers decided
(refuted), and the wrong verdicts. Writes bench/results/checking.json and .md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phi4cli.text.checker import Checker  # noqa: E402

DATA = ROOT / "bench" / "data"
RESULTS = ROOT / "bench" / "results"


def plus_one(answer: str) -> str | None:
    match = re.search(r"\d+", answer)
    if match is None:
        return None
    return answer[: match.start()] + str(int(match.group()) + 1) + answer[match.end() :]


def doubled(answer: str) -> str | None:
    numbers = list(re.finditer(r"\d+", answer))
    if not numbers or int(numbers[-1].group()) == 0:
        return None
    last = numbers[-1]
    return answer[: last.start()] + str(2 * int(last.group())) + answer[last.end() :]


def negated(answer: str) -> str | None:
    if not re.search(r"[1-9]", answer) or "," in answer or "=" in answer:
        return None  # (a zero, a list or an equation: negating it is not one wrong answer)
    return f"-({answer})"


PERTURBATIONS: dict[str, Callable[[str], str | None]] = {
    "plus_one": plus_one,
    "doubled": doubled,
    "negated": negated,
}


def rows(split: str) -> list[dict[str, Any]]:
    found = []
    for name in ("math500", "gsm8k"):
        for line in (DATA / f"{name}.jsonl").read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            part = "dev" if row["index"] % 2 == 0 else "holdout"
            if split in ("both", part):
                row["split"] = part
                row["subject"] = f"MATH-500 {row['subject']}" if name == "math500" else "GSM8K"
                found.append(row)
    return found


def measure(split: str) -> dict[str, Any]:
    table: dict[str, Counter[str]] = defaultdict(Counter)
    wrong: list[dict[str, Any]] = []
    started = time.monotonic()
    with Checker() as checker:
        for row in rows(split):
            counts = table[f"{row['split']} / {row['subject']}"]
            counts["problems"] += 1
            right = checker.check(row["problem"], row["answer"])
            counts[f"right_{right.verdict}"] += 1
            if right.verdict == "refuted":
                wrong.append(
                    {
                        "row": row["index"],
                        "subject": row["subject"],
                        "answer": row["answer"],
                        "verdict": "refuted",
                        "detail": right.detail,
                    }
                )
            for kind, perturb in PERTURBATIONS.items():
                answer = perturb(row["answer"])
                if answer is None:
                    continue
                found = checker.check(row["problem"], answer)
                counts["wrong_answers"] += 1
                counts[f"wrong_{found.verdict}"] += 1
                if found.verdict == "verified":
                    wrong.append(
                        {
                            "row": row["index"],
                            "subject": row["subject"],
                            "answer": answer,
                            "perturbation": kind,
                            "verdict": "verified",
                            "detail": found.detail,
                        }
                    )
        timed_out = checker.timed_out
    return {
        "split": split,
        "table": {k: dict(v) for k, v in sorted(table.items())},
        "wrong_verdicts": wrong,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - started, 1),
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Answer checker on MATH-500 and GSM8K ({result['split']})",
        "",
        "| split / subject | problems | reference verified | reference refuted (wrong) "
        "| wrong answers | wrong refuted | wrong verified (wrong) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, c in result["table"].items():
        problems, wrongs = c.get("problems", 0), c.get("wrong_answers", 0)
        verified, refuted = c.get("right_verified", 0), c.get("wrong_refuted", 0)
        lines.append(
            f"| {name} | {problems} | {verified} ({verified / problems:.1%}) "
            f"| {c.get('right_refuted', 0)} | {wrongs} "
            f"| {refuted} ({refuted / wrongs:.1%}) | {c.get('wrong_verified', 0)} |"
            if problems and wrongs
            else f"| {name} | {problems} | {verified} | "
            f"{c.get('right_refuted', 0)} | {wrongs} | {refuted} | {c.get('wrong_verified', 0)} |"
        )
    lines += [
        "",
        f"Wrong verdicts: {len(result['wrong_verdicts'])}. Checks cut off at 1 s: "
        f"{result['timed_out']}. {result['seconds']} s in all.",
    ]
    for verdict in result["wrong_verdicts"]:
        lines.append(
            f"- row {verdict['row']} ({verdict['subject']}): {verdict['answer']!r} "
            f"{verdict['verdict']}: {verdict['detail']}"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=("dev", "holdout", "both"), default="both")
    args = parser.parse_args()
    result = measure(args.split)
    RESULTS.mkdir(exist_ok=True)
    stem = "checking" if args.split == "both" else f"checking-{args.split}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
