"""Deterministic mode: which of the daemon's histories change a greedy answer, and what the
mode costs, measured on the engine itself (no daemon, no socket) in one run.

    python bench/determinism.py --model PATH [--tokens 48] [--kv-layout shared|streams]

One greedy question is answered on a fresh engine, then again after each of: the same question
(its prompt taken from the cache), four other questions, three samples of it at t=0.8 at once,
and beside a concurrent request — each time normally and in deterministic mode. It prints, for
each history, whether the answer's tokens equal the fresh engine's (and at which token they
first differ), then the cost: one request alone normally and deterministically, and four
requests sent together normally (batched) and deterministically (one after another), in CPU
seconds and completion tokens per CPU second (this process's, so that a busy machine's other load
does not count), medians of ``--rounds`` in the same run, the modes taking turns to go first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phi4cli.core._settings import Ask  # noqa: E402
from phi4cli.core.config import DEFAULT_INSTRUCTION, Settings  # noqa: E402
from phi4cli.core.protocol import Event, EventKind, parse_solve_params  # noqa: E402
from phi4cli.daemon.jobs import Job  # noqa: E402
from phi4cli.daemon.llama.batch import LlamaEngine  # noqa: E402

QUESTION = f"What is 2+2?\n\n{DEFAULT_INSTRUCTION}"
OTHERS = ["What is 3+5?", "What is 7*8?", "What is 10-4?", "Name a prime above 20."]


def job(prompt: str, tokens: int, deterministic: bool, **extra: Any) -> tuple[Job, list[str]]:
    pieces: list[str] = []

    def emit(event: Event) -> None:
        if event.kind in (EventKind.TOKEN, EventKind.REASONING):
            pieces.append(event.text)

    params = parse_solve_params(
        {
            "prompt": prompt,
            "temperature": 0,
            "max_tokens": tokens,
            "deterministic": deterministic,
            **extra,
        },
        Ask.of(Settings()),
    )
    return Job(request_id=0, params=params, emit=emit), pieces


def run(engine: LlamaEngine, jobs: list[Job]) -> tuple[float, int]:
    """Decode ``jobs`` to the end, admitting each as the engine takes it (a deterministic one
    only when nothing else runs, and nothing beside it, as the scheduler does); return the
    CPU seconds it took (this process's: the machine's other load does not count, as it does
    in wall time on a busy machine) and the tokens generated."""
    started = time.process_time()
    waiting, running, tokens = list(jobs), set[Job](), 0
    while waiting or running:
        while waiting and not any(j.params.ask.deterministic for j in running):
            if waiting[0].params.ask.deterministic and engine.active:
                break
            if engine.admit(waiting[0]) is not None:
                break
            running.add(waiting.pop(0))
        for done, stats in engine.step():
            running.discard(done)
            tokens += stats.completion_tokens
    return time.process_time() - started, tokens


def answer(engine: LlamaEngine, tokens: int, deterministic: bool, beside: str = "") -> str:
    main, pieces = job(QUESTION, tokens, deterministic)
    jobs = [main]
    if beside:
        other, _ = job(beside, tokens * 3, False)
        jobs = [other, main]
    run(engine, jobs)
    return "".join(pieces)


def first_difference(a: str, b: str) -> str:
    if a == b:
        return "same"
    index = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return f"DIFFERENT from character {index}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--kv-layout", default="shared")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    settings = Settings(kv_layout=args.kv_layout, n_ctx=4096, ramdisk="off", threads=args.threads)
    engine = LlamaEngine(settings)
    engine.load(args.model)
    engine.warm()
    n = args.tokens
    histories: list[tuple[str, Any]] = [
        ("the same question again (prompt cache)", lambda: None),
        ("four other questions", lambda: run(engine, [job(q, n, False)[0] for q in OTHERS])),
        (
            "-k 3 at t=0.8",
            lambda: run(
                engine, [job(QUESTION, n, False, temperature=0.8, seed=s)[0] for s in (1, 2, 3)]
            ),
        ),
    ]
    for deterministic in (False, True):
        engine.load(args.model)  # fresh
        engine.warm()
        fresh = answer(engine, n, deterministic)
        mode = "deterministic" if deterministic else "normal"
        print(f"{mode}: fresh answer {fresh[:60]!r}...")
        for name, history in histories:
            history()
            print(f"  after {name}: {first_difference(fresh, answer(engine, n, deterministic))}")
        beside = answer(engine, n, deterministic, beside="Write a long story about numbers.")
        print(f"  beside a concurrent request: {first_difference(fresh, beside)}")
    # Cost, in the same run: each round both modes, in alternating order, on questions new to
    # the cache (but for the system prompt and the instruction's words).
    costs: dict[str, dict[str, list[float]]] = {}
    for round_ in range(args.rounds):
        modes = [("normal", False), ("deterministic", True)]
        for name, deterministic in modes if round_ % 2 == 0 else modes[::-1]:
            tag = f"(round {round_}, {name})"
            alone, _ = run(engine, [job(f"{tag} {QUESTION}", n, deterministic)[0]])
            seconds, tokens = run(engine, [job(f"{tag} {q}", n, deterministic)[0] for q in OTHERS])
            cost = costs.setdefault(name, {"alone": [], "rate": []})
            cost["alone"].append(alone)
            cost["rate"].append(tokens / seconds)
            print(
                f"  round {round_} {name}: alone {alone:.2f} s, four {tokens} tokens in "
                f"{seconds:.2f} s",
                flush=True,
            )
    for name, cost in costs.items():
        print(
            f"{name}: one request {statistics.median(cost['alone']):.2f} CPU s; four sent "
            f"together {statistics.median(cost['rate']):.1f} tokens per CPU s "
            f"(medians of {args.rounds} rounds)"
        )
    engine.close()


if __name__ == "__main__":
    main()
