"""Votes replayed as the CLI runs them: the early stop of ``solve -k`` / ``eval -k`` (the CLI's own
``phi4cli.client.voting.EarlyStop``, not a copy of its rule) fed each problem's samples in the
order they finished, the samples it cancels paying for the tokens they had written by then.

    python bench/votes.py simulate [--problems 2000] [--k 8] [--parallel 4] [--seeds 5]
                                   [--checkable P]
    python bench/votes.py replay RESULTS.jsonl [--stop-unsure]

``simulate``: synthetic problems (the answer mixtures of ``bench/adaptive_samples.py``; a trace's
length lognormal around 3,000 tokens), their K samples run ``--parallel`` at a time as the
daemon's memory plan runs them (each starts when a slot frees; all decode at one rate), over
``--seeds`` seeds. ``replay``: the samples an ``eval -k K --all`` run recorded (its results
file's ``sample_details``: answer, tokens, when each ended and how long it took) — real samples
of a real model, in the order they really finished.

For each: tokens and samples against all K run to their end, how often the early stop's answer
is the full-K vote's (over problems whose full-K vote is not a tie), how often the full-K vote is
a tie, and (with references) the accuracy of both. ``--stop-unsure`` adds DeepConf's confidence
rule (``--stop-unsure``): a sample whose lowest group confidence is under the floor the first
samples set does not vote (offline the moment it would have been stopped is not known: it is
counted as paying for all its tokens, an upper bound).

Writes bench/results/votes-<what>.json and .md (``--out`` another folder).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.adaptive_samples import MEDIAN_TOKENS, MIXTURES, TOKENS_SIGMA, draw_problem  # noqa: E402
from phi4cli.backends.outcome import Outcome  # noqa: E402
from phi4cli.client.voting import EarlyStop, votes  # noqa: E402
from phi4cli.core.protocol import Stats  # noqa: E402
from phi4cli.text.check_verdicts import Check  # noqa: E402
from phi4cli.text.reasoning import AnswerComparer, majority_vote  # noqa: E402

RATE = 10.0  # tokens a second a stream decodes, in the simulation (only the order matters)


@dataclass
class Sample:
    answer: str | None
    tokens: int
    start_s: float
    end_s: float
    confidence: float | None = None
    verdict: str | None = None  # its answer checked: "verified", "refuted", "unchecked"


@dataclass
class Replayed:
    answer: str | None  # the early stop's vote
    full: str | None  # all K samples' vote
    tie: bool  # the full-K vote is a tie
    tokens: int  # paid with the early stop
    full_tokens: int
    used: int  # samples that voted


def _outcome(index: int, sample: Sample, unsure: bool) -> Outcome:
    outcome = Outcome(index=index, question="")
    outcome.solution = f"\\boxed{{{sample.answer}}}" if sample.answer is not None else ""
    outcome.stats = Stats(
        completion_tokens=sample.tokens,
        finish_reason="unsure" if unsure else "stop",
        lowest_group_confidence=sample.confidence,
    )
    outcome.done = True
    if sample.verdict is not None:
        outcome.check = Check(sample.verdict, "")
    return outcome


def replay(samples: list[Sample], compare: Any, stop_unsure: bool = False) -> Replayed:
    """One problem's K samples through the CLI's EarlyStop, in the order they ended."""
    k = len(samples)
    cancelled_at: dict[int, float] = {}
    floor: list[float] = []
    now = 0.0

    def cancel(i: int) -> None:
        cancelled_at[i] = now

    def adjust(_i: int, value: float) -> None:
        floor[:] = [value]

    stop = EarlyStop(k, compare, cancel, adjust if stop_unsure else None)
    for i in sorted(range(k), key=lambda i: samples[i].end_s):
        sample = samples[i]
        if i in cancelled_at and sample.end_s > cancelled_at[i]:
            continue  # stopped while running (one that had just ended votes: EarlyStop.end)
        now = sample.end_s
        unsure = bool(floor) and sample.confidence is not None and sample.confidence < floor[0]
        stop.end(i, _outcome(i, sample, unsure))
    tokens = 0
    for i, sample in enumerate(samples):
        if i not in stop.stopped:
            tokens += sample.tokens
            continue
        ran = cancelled_at[i] - sample.start_s
        took = sample.end_s - sample.start_s
        share = min(1.0, max(0.0, ran / took)) if took > 0 else 0.0
        tokens += round(sample.tokens * share)
    kept = [i for i in range(k) if i not in stop.stopped and i not in stop.unsure]
    # The vote as the CLI takes it (voting.votes: a verified answer first, a refuted one not).
    voting = votes([_outcome(i, samples[i], False) for i in kept])
    full = majority_vote(
        votes([_outcome(i, s, False) for i, s in enumerate(samples)]), equal=compare
    )
    return Replayed(
        majority_vote(voting, equal=compare).answer,
        full.answer,
        full.tie,
        tokens,
        sum(s.tokens for s in samples),
        len(voting),
    )


def simulated(
    rng: random.Random, k: int, parallel: int, mixture: str, checkable: float = 0.0
) -> list[Sample]:
    """A synthetic problem's K samples, run ``parallel`` at a time; with chance ``checkable``
    the problem is one the checker decides: its right answer verified, the others refuted (the
    checker's measured wrong verdicts: none)."""
    answers = draw_problem(rng, k, mixture)
    decided = checkable > 0 and rng.random() < checkable  # (no draw at 0: the same problems)
    free = [0.0] * parallel  # when each slot frees
    samples = []
    for answer in answers:
        start = heapq.heappop(free)
        tokens = max(50, round(rng.lognormvariate(math.log(MEDIAN_TOKENS), TOKENS_SIGMA)))
        end = start + tokens / RATE
        heapq.heappush(free, end)
        verdict = (
            None
            if not decided or answer is None
            else ("verified" if answer == "right" else "refuted")
        )
        samples.append(Sample(answer, tokens, start, end, rng.uniform(5.0, 15.0), verdict))
    return samples


def summarise(
    rows: list[Replayed], correct: list[tuple[bool, bool]] | None, compare: Any
) -> dict[str, Any]:
    untied = [r for r in rows if not r.tie and r.full is not None]
    agree = sum(r.answer is not None and compare(r.answer, r.full or "") for r in untied)
    summary: dict[str, Any] = {
        "problems": len(rows),
        "tokens_saved": 1 - sum(r.tokens for r in rows) / max(1, sum(r.full_tokens for r in rows)),
        "mean_samples": statistics.fmean(r.used for r in rows) if rows else 0.0,
        "agreement_untied": agree / len(untied) if untied else None,
        "tie_rate": sum(r.tie for r in rows) / len(rows) if rows else 0.0,
    }
    if correct is not None:
        summary["accuracy_early"] = statistics.fmean(c[0] for c in correct) if correct else None
        summary["accuracy_full"] = statistics.fmean(c[1] for c in correct) if correct else None
    return summary


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "k": args.k,
        "parallel": args.parallel,
        "checkable": args.checkable,
        "mixtures": {},
    }
    compare = str.__eq__  # the simulation's answers are labels: "right", "d0", ...
    for mixture in MIXTURES:
        seeds = []
        for seed in range(1, args.seeds + 1):
            rng = random.Random(seed)
            rows, correct = [], []
            for _ in range(args.problems):
                row = replay(
                    simulated(rng, args.k, args.parallel, mixture, args.checkable),
                    compare,
                    args.stop_unsure,
                )
                rows.append(row)
                correct.append((row.answer == "right", row.full == "right"))
            seeds.append({"seed": seed, **summarise(rows, correct, compare)})
        result["mixtures"][mixture] = seeds
    return result


def from_records(path: Path) -> tuple[list[list[Sample]], list[str]]:
    """The problems of an ``eval -k K --all`` results file: each one's samples and reference."""
    problems, references = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        details = record.get("sample_details")
        if not details:
            raise SystemExit(f"{path}: a record without sample_details (run eval -k K --all)")
        if any(d["cancelled"] for d in details):
            raise SystemExit(f"{path}: samples were cancelled: replay needs all K (--all)")
        problems.append(
            [
                Sample(
                    d["answer"],
                    d["completion_tokens"],
                    d["ended_s"] - (d["seconds"] or 0.0),
                    d["ended_s"],
                    d["confidence"],
                    d.get("check"),
                )
                for d in details
            ]
        )
        references.append(str(record["reference"]))
    return problems, references


def replay_file(args: argparse.Namespace) -> dict[str, Any]:
    problems, references = from_records(args.results)
    compare = AnswerComparer()
    rows, correct = [], []
    for samples, reference in zip(problems, references, strict=True):
        row = replay(samples, compare, args.stop_unsure)
        rows.append(row)
        correct.append(
            (
                row.answer is not None and compare(row.answer, reference),
                row.full is not None and compare(row.full, reference),
            )
        )
    single = [
        s.answer is not None and compare(s.answer, ref)
        for samples, ref in zip(problems, references, strict=True)
        for s in samples
    ]
    return {
        "results": str(args.results),
        "k": len(problems[0]) if problems else 0,
        "sample_accuracy": statistics.fmean(single) if single else None,
        **summarise(rows, correct, compare),
    }


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def markdown(result: dict[str, Any]) -> str:
    if "mixtures" in result:
        lines = [
            f"Simulated: K = {result['k']}, {result['parallel']} at a time, "
            f"{result.get('checkable', 0):.0%} of problems checkable; each cell: "
            "median over the seeds (lowest to highest).",
            "",
            "| mixture | tokens saved | samples that voted | agrees with full-K (no tie) | "
            "full-K ties | accuracy early / full-K |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, seeds in result["mixtures"].items():

            def cell(key: str, pct: bool = True, seeds: list[dict[str, Any]] = seeds) -> str:
                values = [s[key] for s in seeds if s[key] is not None]
                show = _pct if pct else (lambda v: f"{v:.2f}")
                low, high = show(min(values)), show(max(values))
                return f"{show(statistics.median(values))} ({low} to {high})"

            lines.append(
                f"| {name} | {cell('tokens_saved')} | {cell('mean_samples', False)} | "
                f"{cell('agreement_untied')} | {cell('tie_rate')} | "
                f"{cell('accuracy_early')} / {cell('accuracy_full')} |"
            )
        return "\n".join(lines) + "\n"
    return (
        f"Replayed {result['results']}: {result['problems']} problems, K = {result['k']}; "
        f"a sample right {_pct(result['sample_accuracy'])}.\n\n"
        "| tokens saved | samples that voted | agrees with full-K (no tie) | full-K ties | "
        "accuracy early / full-K |\n| --- | --- | --- | --- | --- |\n"
        f"| {_pct(result['tokens_saved'])} | {result['mean_samples']:.2f} | "
        f"{_pct(result['agreement_untied'])} | {_pct(result['tie_rate'])} | "
        f"{_pct(result['accuracy_early'])} / {_pct(result['accuracy_full'])} |\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sim = sub.add_parser("simulate")
    sim.add_argument("--problems", type=int, default=2000)
    sim.add_argument("--k", type=int, default=8)
    sim.add_argument("--parallel", type=int, default=4)
    sim.add_argument("--seeds", type=int, default=5)
    sim.add_argument("--stop-unsure", action="store_true")
    sim.add_argument(
        "--checkable",
        type=float,
        default=0.0,
        help="share of problems whose answers the checker decides",
    )
    rep = sub.add_parser("replay")
    rep.add_argument("results", type=Path)
    rep.add_argument("--stop-unsure", action="store_true")
    for each in (sim, rep):
        each.add_argument(
            "--out",
            type=Path,
            default=ROOT / "bench" / "results",
            help="folder of the results files",
        )
    args = parser.parse_args()
    result = simulate(args) if args.what == "simulate" else replay_file(args)
    name = args.what if args.what == "simulate" else f"replay-{args.results.stem}"
    name += "-unsure" if args.stop_unsure else ""
    name += f"-checkable{round(100 * args.checkable)}" if getattr(args, "checkable", 0) else ""
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / f"votes-{name}.json").write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    text = markdown(result)
    (out / f"votes-{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
