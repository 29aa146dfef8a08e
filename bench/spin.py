"""How long the daemon's threads spin before they sleep: the figures docs/benchmarks.md cites.

    python bench/spin.py --model PATH [--spins 10000 100000 300000] [--prompt 1000]
                         [--tokens 64] [--rounds 3] [--duty 0.5]

llama.cpp's CPU threads meet at a barrier after every operation. A thread that arrives early
spins ``GOMP_SPINCOUNT`` turns, then sleeps (libgomp reads it once, when the daemon loads
llama.cpp). For each spin count a daemon is started with ``--threads`` all cores. In each of
``--rounds`` interleaved passes it:

- reads a fresh prompt of ``--prompt`` words on the quiet machine (one token answered), timing
  the prompt from the daemon's own stats (the table says how many tokens that was);
- decodes ``--tokens`` greedy tokens on the quiet machine;
- decodes them again beside one process busy ``--duty`` of each 100 ms (the light load where a
  short spin pays), unless ``--duty 0``.

Reported: the median prompt-reading and decode rates, each against the longest spin's in the same
pass (the ratio's median over the passes), and busy / quiet. Writes
bench/results/spin-<model>.json and .md, and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
from contextlib import AbstractContextManager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.contention import busy, phi4_running, solve_stats  # noqa: E402
from bench.speed import QUESTION  # noqa: E402

WORDS = (
    "the",
    "number",
    "of",
    "ways",
    "to",
    "choose",
    "two",
    "points",
    "from",
    "a",
    "grid",
    "is",
    "given",
    "by",
    "sum",
    "over",
    "all",
    "pairs",
    "and",
    "then",
)


def prompt_text(tokens: int, seed: int) -> str:
    """A question of about ``tokens`` tokens (about one a word) that no earlier one starts like:
    the daemon reads it whole."""
    rng = random.Random(seed)
    return f"Case {seed}: " + " ".join(rng.choice(WORDS) for _ in range(tokens)) + "?"


def daemon(model: Path, spin: int) -> AbstractContextManager[dict[str, str]]:
    """A daemon on all cores whose threads spin ``spin`` turns; yields its environment."""
    cores = str(len(os.sched_getaffinity(0)))
    return phi4_running(model, ["--threads", cores], {**os.environ, "GOMP_SPINCOUNT": str(spin)})


def solve(env: dict[str, str], model: Path, question: str, tokens: int) -> dict[str, float]:
    stats = solve_stats(env, model, question, tokens)
    return {
        "prompt_tokens_per_s": stats["prompt_eval_tokens"] / max(stats["prompt_eval_s"], 1e-9),
        "prompt_tokens": stats["prompt_eval_tokens"],
        "decode_tokens_per_s": (stats["completion_tokens"] - 1) / max(stats["decode_s"], 1e-9),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--spins", type=int, nargs="+", default=[10000, 100000, 300000])
    parser.add_argument("--prompt", type=int, default=1000, help="words of the prompt read")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--duty",
        type=float,
        default=0.5,
        help="the busy process's share of the time (0: no busy pass)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    longest = max(args.spins)
    runs: dict[int, dict[str, list[float]]] = {
        spin: {
            "prompt": [],
            "quiet": [],
            "busy": [],
            "prompt_vs": [],
            "decode_vs": [],
            "prompt_tokens": [],
        }
        for spin in args.spins
    }
    seed = 0
    for round_ in range(args.rounds):
        order = args.spins if round_ % 2 == 0 else list(reversed(args.spins))
        passed: dict[int, dict[str, float]] = {}
        for spin in order:
            with daemon(args.model, spin) as env:
                solve(env, args.model, QUESTION, 8)  # warm-up
                seed += 1
                read = solve(env, args.model, prompt_text(args.prompt, seed), 1)
                quiet = solve(env, args.model, QUESTION, args.tokens)
                loaded = None
                if args.duty > 0:
                    with busy(1, args.duty):
                        loaded = solve(env, args.model, QUESTION, args.tokens)
            passed[spin] = {
                "prompt": read["prompt_tokens_per_s"],
                "prompt_tokens": read["prompt_tokens"],
                "quiet": quiet["decode_tokens_per_s"],
                "busy": loaded["decode_tokens_per_s"] if loaded else 0.0,
            }
            print(
                f"pass {round_ + 1}, spin {spin:,}: prompt {read['prompt_tokens']} tokens at "
                f"{passed[spin]['prompt']:.1f} tok/s; decode {passed[spin]['quiet']:.2f} tok/s "
                f"quiet, {passed[spin]['busy']:.2f} busy",
                file=sys.stderr,
            )
        for spin, rates in passed.items():
            for key, value in rates.items():
                runs[spin][key].append(value)
            runs[spin]["prompt_vs"].append(rates["prompt"] / passed[longest]["prompt"])
            runs[spin]["decode_vs"].append(rates["quiet"] / passed[longest]["quiet"])
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    lines = [
        f"Spin counts on {args.model.name} ({machine}), {args.rounds} interleaved passes, "
        f"a prompt of {args.prompt} words (a median of "
        f"{statistics.median(t for r in runs.values() for t in r['prompt_tokens']):.0f} tokens), "
        f"{args.tokens} tokens decoded, busy: one "
        f"process {args.duty:.0%} of each 100 ms.",
        "",
        f"| GOMP_SPINCOUNT | prompt read | vs {longest:,} | decode, quiet | vs {longest:,} "
        "| decode, busy | busy / quiet |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    summary = {}
    for spin in args.spins:
        r = runs[spin]
        med = {key: statistics.median(values) for key, values in r.items() if values}
        ratio = statistics.median(b / q for b, q in zip(r["busy"], r["quiet"], strict=True))
        summary[spin] = {**med, "busy_over_quiet": ratio, "passes": r}
        lines.append(
            f"| {spin:,} | {med['prompt']:.1f} tok/s | {med['prompt_vs']:.2f}x | "
            f"{med['quiet']:.2f} tok/s | {med['decode_vs']:.2f}x | "
            f"{med['busy']:.2f} tok/s | {ratio:.2f}x |"
        )
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"spin-{args.model.stem}"
    (args.out / f"{stem}.json").write_text(
        json.dumps(
            {
                "model": str(args.model),
                "machine": machine,
                "rounds": args.rounds,
                "prompt": args.prompt,
                "tokens": args.tokens,
                "duty": args.duty,
                "spins": summary,
            },
            indent=2,
        )
        + "\n"
    )
    (args.out / f"{stem}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
