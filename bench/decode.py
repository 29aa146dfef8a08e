"""Decode rate: phi4's daemon against in-process llama-cpp-python, interleaved rounds.

    python bench/decode.py [--model smollm2-135m|PATH] [--tokens 256] [--rounds 6]
                           [--daemon-arg ARG] [--daemon-env NAME=VALUE]

One greedy answer of ``--tokens`` tokens to the same question, in each round: the daemon's best of
two (its own stats' decode seconds, first token excluded) and a fresh in-process llama-cpp-python's
best of two (``create_chat_completion`` streamed, from its first content token), on the same
threads (all physical cores). Reported: each round's rates and their ratio, and the median ratio.
``--daemon-arg`` passes more to `phi4 daemon start` (e.g. ``--daemon-arg=--threads
--daemon-arg=2`` fixes the threads), ``--daemon-env`` sets a variable for the daemon alone (e.g.
``GOMP_SPINCOUNT=300000``, the spin of in-process llama.cpp's OpenMP threads, where the daemon's
is a third of it: see ``phi4cli/daemon/threads.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.speed import PHI4  # noqa: E402

QUESTION = "Write a long story about numbers."
IN_PROCESS = r"""
import sys, time, llama_cpp
model, question, threads, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model, n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                      verbose=False)
best = 0.0
for _ in range(2):
    first, count = None, 0
    for chunk in llm.create_chat_completion([{"role": "user", "content": question}],
                                            max_tokens=tokens, temperature=0, stream=True):
        if chunk["choices"][0]["delta"].get("content"):
            count += 1
            first = first or time.monotonic()
    best = max(best, (count - 1) / (time.monotonic() - first))
    llm.reset()
print(best)
"""


def daemon_stats(home: Path, question: str, tokens: int) -> Any:
    """The stats of the daemon's greedy answer of ``tokens`` tokens to ``question``."""
    from phi4cli.backends.daemon_link import DaemonConnection
    from phi4cli.core.protocol import EventKind

    with DaemonConnection.open(home / "run" / "daemon.sock") as connection:
        stats = None
        for event in connection.request(
            "solve", {"prompt": question, "temperature": 0, "max_tokens": tokens}, timeout=3600
        ):
            if event.kind == EventKind.STATS:
                stats = event.stats
    assert stats is not None and stats.decode_s
    return stats


def daemon_rate(home: Path, tokens: int) -> float:
    stats = daemon_stats(home, QUESTION, tokens)
    return float((stats.completion_tokens - 1) / stats.decode_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--daemon-arg", action="append", default=[])
    parser.add_argument("--daemon-env", action="append", default=[])
    args = parser.parse_args()

    from bench.harness import start_daemon
    from phi4cli.core.machine import physical_cores
    from phi4cli.core.models import resolve_model
    from phi4cli.core.paths import get_paths

    model = resolve_model(args.model, get_paths())
    threads = physical_cores()
    home = Path(tempfile.mkdtemp(prefix="p4dec-", dir="/tmp"))
    env = {
        **os.environ,
        "PHI4_HOME": str(home),
        **dict(item.split("=", 1) for item in args.daemon_env),
    }
    # (Once its whole context is made: in-process llama-cpp-python makes its own before it answers.)
    start_daemon(model, env, args.daemon_arg)
    ratios = []
    try:
        daemon_rate(home, 8)  # (its first request allocates buffers)
        for round_ in range(args.rounds):
            ours = max(daemon_rate(home, args.tokens) for _ in range(2))
            theirs = float(
                subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        IN_PROCESS,
                        str(model),
                        QUESTION,
                        str(threads),
                        str(args.tokens),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )
            ratios.append(ours / theirs)
            print(
                f"round {round_}: daemon {ours:.2f} tok/s, in-process {theirs:.2f} tok/s, "
                f"{ratios[-1]:.3f}x",
                flush=True,
            )
    finally:
        subprocess.run([*PHI4, "stop"], env=env, capture_output=True, check=False)
    print(
        f"median {statistics.median(ratios):.3f}x over {args.rounds} rounds "
        f"({model.name}, {os.cpu_count()} CPUs, {threads} threads)"
    )


if __name__ == "__main__":
    main()
