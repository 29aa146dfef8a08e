"""Adaptive samples, simulated: how many samples each stopping rule takes, against fixed K.

    python bench/adaptive_samples.py [--problems 2000] [--k 8] [--parallel 4] [--seed 1]

A simulation, not a measurement of Phi-4-mini-reasoning (whose weights cannot be downloaded
here). Each synthetic problem has a chance p that a sample is right, drawn from a stated
mixture (easy: Beta(20, 1), 60%; middling: Beta(4, 2), 30%; hard: Beta(1, 3), 10%); a wrong
sample says one of three distractors (weights from Dirichlet(1, 1, 1)), and 5% of samples state
no answer. For each rule, per problem: the samples that finished, the samples started (with
``--parallel`` at once, as the daemon's memory plan lets them run: a settled vote cancels the
ones running), and whether the voted answer is the full-K majority's. The rules:

- fixed K: today's ``--all``;
- beta-C: Adaptive-Consistency's Beta rule at confidence C, and stop when the rest cannot
  change the leader (``reasoning.vote_settled``; phi4's default is 0.93, the paper's 0.95);
- esc-W: Early-stopping self-consistency, in windows of W: stop when a window agrees.

Writes bench/results/adaptive_samples.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phi4cli.text.confidence import GROUP, WARMUP, floor_from  # noqa: E402
from phi4cli.text.reasoning import STOP_CONFIDENCE, majority_vote, vote_settled  # noqa: E402

# Mixtures of problems: (share, alpha, beta) of the Beta each problem's chance p is drawn from,
# and the share of samples that state no answer. "stated" is the one the table has always used;
# the other two are set so that a sample's accuracy is about Phi-4-mini-reasoning's reported
# pass@1 (91.2% on MATH-500, 48.1% on AIME 2024, in the comparison table of the
# Phi-4-mini-flash-reasoning report, arXiv 2507.06607).
MIXTURES: dict[str, tuple[tuple[tuple[float, float, float], ...], float]] = {
    "stated": (((0.6, 20.0, 1.0), (0.3, 4.0, 2.0), (0.1, 1.0, 3.0)), 0.05),
    "MATH-500-like": (((0.93, 20.0, 1.0), (0.05, 4.0, 2.0), (0.02, 1.0, 3.0)), 0.02),
    "AIME-like": (((0.22, 20.0, 1.0), (0.2, 4.0, 2.0), (0.58, 1.0, 3.0)), 0.02),
}
MIXTURE, NO_ANSWER = MIXTURES["stated"]
MEDIAN_TOKENS, TOKENS_SIGMA = 3000.0, 0.5  # a trace's length: lognormal, the same right or wrong


def draw_problem(rng: random.Random, k: int, mixture: str = "stated") -> list[str | None]:
    """K samples' answers of one synthetic problem ("right", "d0", "d1", "d2" or None)."""
    shares, no_answer = MIXTURES[mixture]
    roll, acc = rng.random(), 0.0
    alpha, beta = shares[-1][1:]
    for share, a, b in shares:
        acc += share
        if roll < acc:
            alpha, beta = a, b
            break
    p = rng.betavariate(alpha, beta)
    weights = [rng.gammavariate(1.0, 1.0) for _ in range(3)]
    answers: list[str | None] = []
    for _ in range(k):
        if rng.random() < no_answer:
            answers.append(None)
        elif rng.random() < p:
            answers.append("right")
        else:
            answers.append(rng.choices(["d0", "d1", "d2"], weights)[0])
    return answers


def equal(a: str, b: str) -> bool:
    return a == b


def beta_rule(
    answers: list[str | None], parallel: int, confidence: float = STOP_CONFIDENCE
) -> tuple[int, int]:
    """(finished, started) under the Beta rule, ``parallel`` samples running at once and
    finishing in the order drawn."""
    k = len(answers)
    finished: list[str | None] = []
    started = min(parallel, k)
    for answer in answers:
        finished.append(answer)
        vote = majority_vote(finished, equal=equal)
        if len(finished) < k and vote_settled(vote, k - len(finished), confidence):
            return len(finished), started
        started = min(k, started + 1)  # a slot freed: the next sample starts
    return k, k


def esc_rule(answers: list[str | None], window: int) -> tuple[int, int]:
    """(finished, started) under ESC: windows of ``window`` samples run together; stop after a
    window whose answers are all one (stated) answer."""
    taken = 0
    while taken < len(answers):
        part = answers[taken : taken + window]
        taken += len(part)
        if part[0] is not None and all(a == part[0] for a in part):
            break
    return taken, taken


RULES = ("fixed", "beta-0.95", "beta-0.93", "esc-2", "esc-4")


def simulate(
    problems: int, k: int, parallel: int, seed: int, mixture: str = "stated"
) -> dict[str, Any]:
    rng = random.Random(seed)
    rules: dict[str, dict[str, list[float]]] = {
        name: {"finished": [], "started": [], "agrees": [], "right": []} for name in RULES
    }
    for _ in range(problems):
        answers = draw_problem(rng, k, mixture)
        full = majority_vote(answers, equal=equal).answer
        for name in rules:
            if name == "fixed":
                finished, started = k, k
            elif name.startswith("beta"):
                finished, started = beta_rule(answers, parallel, float(name.split("-")[1]))
            else:
                finished, started = esc_rule(answers, int(name.split("-")[1]))
            voted = majority_vote(answers[:finished], equal=equal).answer
            row = rules[name]
            row["finished"].append(finished)
            row["started"].append(started)
            row["agrees"].append(voted == full)
            row["right"].append(voted == "right")
    return {
        name: {
            "mean_samples": statistics.fmean(row["finished"]),
            "mean_started": statistics.fmean(row["started"]),
            "fewer_than_fixed": k / statistics.fmean(row["finished"]),
            "agreement_with_full_k": statistics.fmean(row["agrees"]),
            "accuracy": statistics.fmean(row["right"]),
        }
        for name, row in rules.items()
    }


# Each sample's confidence (its lowest group confidence): a right one's drawn from
# N(CONF_WRONG + d * CONF_SPREAD, CONF_SPREAD), a wrong one's from N(CONF_WRONG, CONF_SPREAD),
# for separations d in SEPARATIONS (0: confidence says nothing about being right).
CONF_WRONG, CONF_SPREAD = 10.0, 1.5
SEPARATIONS = (0.0, 0.5, 1.0, 2.0)


def confidence_votes(problems: int, k: int, seed: int) -> dict[str, dict[str, float]]:
    """Accuracy of fixed-K votes by count, weighted by confidence (``--vote confidence``), and
    weighted over the more confident half only (DeepConf's filter at 50%), per separation."""
    rng = random.Random(seed + 1)
    drawn = [draw_problem(rng, k) for _ in range(problems)]
    table: dict[str, dict[str, float]] = {}
    for separation in SEPARATIONS:
        right = {"count": 0, "confidence": 0, "confidence, top half": 0}
        for answers in drawn:
            conf = [
                max(
                    0.1,
                    rng.gauss(
                        CONF_WRONG + (separation * CONF_SPREAD if a == "right" else 0.0),
                        CONF_SPREAD,
                    ),
                )
                for a in answers
            ]
            keep = sorted(range(k), key=lambda i: -conf[i])[: k // 2]
            votes = {
                "count": majority_vote(answers, equal=equal).answer,
                "confidence": majority_vote(answers, equal=equal, weights=conf).answer,
                "confidence, top half": majority_vote(
                    [answers[i] for i in keep], equal=equal, weights=[conf[i] for i in keep]
                ).answer,
            }
            for name, answer in votes.items():
                right[name] += answer == "right"
        table[f"d = {separation:g}"] = {name: count / problems for name, count in right.items()}
    return table


def online_rule(
    answers: list[str | None],
    conf: list[float],
    lengths: list[float],
    stops: list[float],
    parallel: int,
    online: bool,
    weighted: bool,
) -> tuple[str | None, float, int]:
    """One problem under the Beta rule (phi4's default), with DeepConf online or without:
    (the voted answer, tokens written, traces stopped as unsure).

    Samples end in the order drawn, ``parallel`` at once. With ``online``, once WARMUP have
    ended the floor is set from their confidences (``confidence.floor_from``), and a later
    sample below it is stopped where its running window first fell under the floor — drawn
    as the fraction ``stops[i]`` of its length, but not before GROUP tokens (a shorter one is
    never stopped) — and does not vote. A settled vote cancels the samples running then: they
    wrote half their tokens."""
    k = len(answers)
    voters: list[str | None] = []
    weights: list[float] = []
    seen: list[float] = []
    floor: float | None = None
    tokens, unsure = 0.0, 0
    for i in range(k):
        if floor is not None and conf[i] < floor and lengths[i] >= GROUP:
            tokens += max(min(lengths[i], GROUP), stops[i] * lengths[i])
            unsure += 1
        else:
            tokens += lengths[i]
            voters.append(answers[i])
            weights.append(conf[i])
        seen.append(conf[i])
        if online and floor is None and len(seen) == WARMUP:
            floor = floor_from(seen)
        left = k - i - 1
        if left and vote_settled(majority_vote(voters, equal=equal), left):
            tokens += sum(0.5 * n for n in lengths[i + 1 : i + parallel])
            break
    vote = majority_vote(voters, equal=equal, weights=weights if weighted else None)
    return vote.answer, tokens, unsure


def online_table(problems: int, k: int, parallel: int, seed: int) -> dict[str, dict[str, float]]:
    """DeepConf online beside the Beta rule alone, per separation d of the confidences (as in
    :func:`confidence_votes`), on the stated mixture: tokens against fixed K, accuracy, and
    agreement with the full-K majority by count."""
    table: dict[str, dict[str, float]] = {}
    for separation in SEPARATIONS:
        rng = random.Random(seed + 2)
        names = ("beta", "beta + stop unsure", "beta + stop unsure, weighted")
        rows = {name: {"tokens": 0.0, "right": 0, "agrees": 0, "unsure": 0} for name in names}
        fixed_tokens = 0.0
        for _ in range(problems):
            answers = draw_problem(rng, k)
            conf = [
                rng.gauss(
                    CONF_WRONG + (separation * CONF_SPREAD if a == "right" else 0.0), CONF_SPREAD
                )
                for a in answers
            ]
            lengths = [rng.lognormvariate(math.log(MEDIAN_TOKENS), TOKENS_SIGMA) for _ in answers]
            stops = [rng.random() for _ in answers]
            fixed_tokens += sum(lengths)
            full = majority_vote(answers, equal=equal).answer
            for name, row in rows.items():
                answer, tokens, unsure = online_rule(
                    answers,
                    conf,
                    lengths,
                    stops,
                    parallel,
                    online=name != "beta",
                    weighted=name.endswith("weighted"),
                )
                row["tokens"] += tokens
                row["right"] += answer == "right"
                row["agrees"] += answer == full
                row["unsure"] += unsure
        for name, row in rows.items():
            table[f"d = {separation:g}: {name}"] = {
                "fewer_tokens_than_fixed": fixed_tokens / row["tokens"],
                "accuracy": row["right"] / problems,
                "agreement_with_full_k": row["agrees"] / problems,
                "stopped_unsure_per_problem": row["unsure"] / problems,
            }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=2000)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--parallel", type=int, default=4, help="samples running at once")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    results = {
        name: simulate(args.problems, args.k, args.parallel, args.seed, name) for name in MIXTURES
    }
    lines = [
        f"# Adaptive samples, simulated ({args.problems:,} problems, K = {args.k}, "
        f"{args.parallel} at once, seed {args.seed})",
        "",
        "| problems | rule | samples finished | samples started | fewer than fixed K | agrees "
        "with full-K majority | accuracy |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mixture, result in results.items():
        for name, row in result.items():
            lines.append(
                f"| {mixture} | {name} | {row['mean_samples']:.2f} | {row['mean_started']:.2f} "
                f"| {row['fewer_than_fixed']:.2f}x | {row['agreement_with_full_k']:.1%} | "
                f"{row['accuracy']:.1%} |"
            )
    votes = confidence_votes(args.problems, args.k, args.seed)
    lines += [
        "",
        f"Votes over all K = {args.k}: accuracy by count and weighted by confidence (right "
        f"samples' confidence N({CONF_WRONG:g} + d * {CONF_SPREAD:g}, {CONF_SPREAD:g}), wrong "
        f"ones' N({CONF_WRONG:g}, {CONF_SPREAD:g}))",
        "",
        "| separation | by count | weighted by confidence | weighted, more confident half |",
        "| --- | --- | --- | --- |",
    ]
    for name, row in votes.items():
        lines.append(
            f"| {name} | {row['count']:.1%} | {row['confidence']:.1%} | "
            f"{row['confidence, top half']:.1%} |"
        )
    online = online_table(args.problems, args.k, args.parallel, args.seed)
    lines += [
        "",
        f"DeepConf online (a floor from the first {WARMUP} traces; stopped traces do not vote) "
        f"beside the Beta rule alone, the stated mixture, traces of median {MEDIAN_TOKENS:g} "
        "tokens",
        "",
        "| separation: rule | fewer tokens than fixed K | accuracy | agrees with full-K "
        "majority | stopped as unsure, a problem |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in online.items():
        lines.append(
            f"| {name} | {row['fewer_tokens_than_fixed']:.2f}x | {row['accuracy']:.1%} "
            f"| {row['agreement_with_full_k']:.1%} | "
            f"{row['stopped_unsure_per_problem']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adaptive_samples.md").write_text(text)
    (args.out / "adaptive_samples.json").write_text(
        json.dumps(
            {
                "args": {k: v for k, v in vars(args).items() if k != "out"},
                "rules": results,
                "confidence_votes": votes,
                "online": online,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
