"""What a token's confidence costs in the daemon: the pass over the vocabulary beside a decode
step, on the model given (the shaped Phi-4-mini model: bench/shaped_model.py).

    python bench/confidence.py --model PATH [--threads 2] [--tokens 32] [--rounds 3]

In one process, on phi4's own engine: requests of ``--tokens`` greedy tokens, 1 and 4 at once,
with confidence off and on, interleaved for ``--rounds`` rounds; and the confidence of one
token timed alone on the model's real logits (1,000 calls). The cost per step is the per-token
time times the requests in the step, against the step's time with confidence off.

Writes bench/results/confidence-<model>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phi4cli.core._settings import Ask, Settings  # noqa: E402
from phi4cli.core.protocol import SolveParams  # noqa: E402
from phi4cli.daemon.jobs import Job  # noqa: E402
from phi4cli.daemon.llama.batch import LlamaEngine  # noqa: E402
from phi4cli.text.confidence import LogitsConfidence  # noqa: E402

QUESTIONS = ("What is 12*13?", "Solve 3x^2+4x+5=1.", "What is 2+2?", "Sum 1 to 10.")


def run_step_times(engine: LlamaEngine, at_once: int, tokens: int, confidence: bool) -> float:
    """Seconds per decode step of ``at_once`` requests (their decode time over their tokens)."""
    jobs = [
        Job(
            i,
            SolveParams(
                f"{QUESTIONS[i % 4]} (round {time.monotonic()})",
                Ask(temperature=0.0, max_tokens=tokens, loop="off"),
                confidence=confidence,
            ),
            lambda _event: None,
        )
        for i in range(at_once)
    ]
    for job in jobs:
        assert engine.admit(job) is None, "the context holds them all"
    done: list[Any] = []
    while len(done) < at_once:
        done += engine.step()
    # Every request decodes in every step once all are reading no prompt: the slowest's rate.
    return float(max(stats.decode_s / max(1, stats.completion_tokens) for _, stats in done))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = LlamaEngine(
        Settings(n_ctx=4096, threads=args.threads, parallel=4, ramdisk="off", kv_layout="shared")
    )
    engine.load(args.model)
    engine.warm()
    model = engine._model
    assert model is not None
    n_vocab = model.model.n_vocab()
    steps: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for at_once in (1, 4):
            for confidence in (False, True):
                key = f"{at_once} at once, confidence {'on' if confidence else 'off'}"
                steps.setdefault(key, []).append(
                    run_step_times(engine, at_once, args.tokens, confidence)
                )
    # One token's confidence alone, on the model's last logits (a real buffer of n_vocab).
    measure = LogitsConfidence(n_vocab)
    logits = model.logits(-1).copy()
    started = time.perf_counter()
    for _ in range(1000):
        measure(logits)
    per_token = (time.perf_counter() - started) / 1000
    rows = {key: statistics.median(values) for key, values in steps.items()}
    result: dict[str, Any] = {
        "model": str(args.model),
        "n_vocab": n_vocab,
        "threads": args.threads,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "confidence_ms_per_token": round(per_token * 1000, 3),
        "step_s_median": {key: round(value, 4) for key, value in rows.items()},
        "cost_of_a_step": {
            f"{n} at once": round(n * per_token / rows[f"{n} at once, confidence off"], 4)
            for n in (1, 4)
        },
    }
    lines = [
        f"# Confidence's cost per decode step: {args.model.name} (vocabulary {n_vocab:,}), "
        f"{args.threads} threads, {args.tokens} tokens, median of {args.rounds} rounds",
        "",
        f"One token's confidence alone: {per_token * 1000:.3f} ms.",
        "",
        "| requests at once | step, confidence off | step, confidence on | its cost (per token "
        "alone x requests / step) |",
        "| --- | --- | --- | --- |",
    ]
    for n in (1, 4):
        off, on = rows[f"{n} at once, confidence off"], rows[f"{n} at once, confidence on"]
        lines.append(
            f"| {n} | {off * 1000:.1f} ms | {on * 1000:.1f} ms | "
            f"{result['cost_of_a_step'][f'{n} at once']:.2%} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"confidence-{args.model.stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"confidence-{args.model.stem}.md").write_text(text)
    engine.close()


if __name__ == "__main__":
    main()
