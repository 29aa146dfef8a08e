"""Chat turns 1..N: time to first token with phi4's resident daemon, against baselines in the
same run — in-process llama-cpp-python given the whole history each turn (its own prefix cache),
and a fresh process per turn (load + whole history, the llama-cli way).

    python bench/chat_turns.py [--model smollm2-135m|PATH] [--turns 10] [--max-tokens 48]

Writes bench/results/chat_turns-<model>.json and .md, and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Questions of one shape and length, so that a turn's cost shows what history adds, not what
# a longer question costs.
QUESTIONS = [f"Next: what is {n} plus {n}?" for n in range(11, 41)]

FRESH_PROCESS = r"""
import json, sys, time
start = time.monotonic()
import llama_cpp
model, messages = sys.argv[1], json.loads(sys.argv[2])
threads, n_ctx = int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                      verbose=False)
for chunk in llm.create_chat_completion(messages, max_tokens=1, temperature=0, stream=True):
    if chunk["choices"][0]["delta"].get("content"):
        break
print(json.dumps({"ttft": time.monotonic() - start}))
"""


def phi4_turns(
    home: Path, model: Path, turns: int, max_tokens: int
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Play the conversation through the daemon; return per-turn rows and the history."""
    from phi4cli.backends.daemon_link import DaemonConnection

    connection = DaemonConnection.open(home / "run" / "daemon.sock")
    history: list[dict[str, str]] = []
    rows = []
    with connection:
        for index in range(turns):
            question = QUESTIONS[index % len(QUESTIONS)]
            params = {
                "session": "bench",
                "message": question,
                "history": history,
                "temperature": 0,
                "max_tokens": max_tokens,
            }
            sent = time.monotonic()
            first = None
            answer = ""
            stats: dict[str, Any] = {}
            for event in connection.request("chat", params):
                if event.kind in ("token", "reasoning") and first is None:
                    first = time.monotonic() - sent
                if event.kind == "token":
                    answer += event.text
                if event.kind == "stats":
                    stats = event.stats.to_dict()
                if event.kind == "error":
                    raise SystemExit(f"phi4 failed: {event}")
            rows.append(
                {
                    "turn": index + 1,
                    "question": question,
                    "ttft_s": first,
                    "prompt_tokens": stats["prompt_tokens"],
                    "evaluated_tokens": stats["prompt_eval_tokens"],
                    "cached_tokens": stats["cached_tokens"],
                }
            )
            history += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
    return rows, history


def in_process_turns(
    model: Path, history: list[dict[str, str]], threads: int, n_ctx: int, max_tokens: int
) -> list[float]:
    """The same conversation in-process: each turn gets the whole history and writes its whole
    answer, so llama-cpp-python's own prefix cache holds what it wrote, as phi4's does."""
    import llama_cpp

    llm = llama_cpp.Llama(
        str(model), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    times = []
    for turn in range(len(history) // 2):
        messages = [*history[: 2 * turn], history[2 * turn]]
        sent = time.monotonic()
        first = None
        # (Typed as an answer or a stream of chunks, of messages typed more narrowly than this.)
        stream: Any = llm.create_chat_completion(
            cast(Any, messages), max_tokens=max_tokens, temperature=0, stream=True
        )
        for chunk in stream:
            if first is None and chunk["choices"][0]["delta"].get("content"):
                first = time.monotonic() - sent
        times.append(first if first is not None else time.monotonic() - sent)
    llm.close()
    return times


def fresh_process_turns(
    model: Path, history: list[dict[str, str]], threads: int, n_ctx: int, turns: list[int]
) -> dict[int, float]:
    results = {}
    for turn in turns:
        messages = [*history[: 2 * (turn - 1)], history[2 * (turn - 1)]]
        started = time.monotonic()
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                FRESH_PROCESS,
                str(model),
                json.dumps(messages),
                str(threads),
                str(n_ctx),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        json.loads(out.stdout)  # the script's own view; the wall time includes interpreter start
        results[turn] = time.monotonic() - started
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    from phi4cli.core.machine import physical_cores
    from phi4cli.core.models import resolve_model
    from phi4cli.core.paths import get_paths

    model = resolve_model(args.model, get_paths())
    threads = physical_cores()
    home = Path(tempfile.mkdtemp(prefix="p4b-", dir="/tmp"))
    env = {**os.environ, "PHI4_HOME": str(home)}
    phi4 = [sys.executable, "-m", "phi4cli"]
    subprocess.run(
        [
            *phi4,
            "daemon",
            "start",
            "-m",
            str(model),
            "--n-ctx",
            str(args.n_ctx),
            "--keep-alive",
            "10m",
        ],
        env=env,
        check=True,
    )
    os.environ["PHI4_HOME"] = str(home)
    try:
        rows, history = phi4_turns(home, model, args.turns, args.max_tokens)
    finally:
        subprocess.run([*phi4, "stop"], env=env, check=False, capture_output=True)
    in_process = in_process_turns(model, history, threads, args.n_ctx, args.max_tokens)
    fresh = fresh_process_turns(model, history, threads, args.n_ctx, [1, args.turns])
    for row, ttft in zip(rows, in_process, strict=True):
        row["in_process_ttft_s"] = ttft
        row["fresh_process_ttft_s"] = fresh.get(row["turn"])
    first, last = rows[0]["ttft_s"], rows[-1]["ttft_s"]
    summary = {
        "model": str(model),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {threads} threads",
        "turns": args.turns,
        "phi4_ttft_last_over_first": round(last / first, 3),
        # Turn 1 has no earlier answer to close, so it evaluates a few tokens fewer than the
        # rest: turn 2 is the like-for-like base for "does the cost grow with history".
        "phi4_ttft_last_over_second": round(last / rows[1]["ttft_s"], 3),
        "phi4_evaluated_tokens_median": statistics.median(r["evaluated_tokens"] for r in rows[1:]),
        "fresh_process_over_phi4_at_last_turn": round(fresh[args.turns] / last, 1),
        "in_process_over_phi4_at_last_turn": round(rows[-1]["in_process_ttft_s"] / last, 2),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"chat_turns-{model.stem}"
    (args.out / f"{name}.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    lines = [
        f"Chat turns on {model.name} ({summary['machine']})",
        "",
        "| turn | prompt tokens | phi4 evaluated | phi4 TTFT | in-process llama-cpp-python TTFT "
        "| fresh process TTFT |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        fresh_s = row["fresh_process_ttft_s"]
        lines.append(
            f"| {row['turn']} | {row['prompt_tokens']} | {row['evaluated_tokens']} | "
            f"{row['ttft_s'] * 1000:.0f} ms | {row['in_process_ttft_s'] * 1000:.0f} ms | "
            + (f"{fresh_s * 1000:.0f} ms |" if fresh_s else "- |")
        )
    lines += [
        "",
        f"phi4 TTFT turn {args.turns} / turn 1: **{summary['phi4_ttft_last_over_first']}x**, "
        f"/ turn 2: **{summary['phi4_ttft_last_over_second']}x**; "
        f"a fresh process per turn is **{summary['fresh_process_over_phi4_at_last_turn']}x** "
        f"slower to its first token at turn {args.turns}; in-process llama-cpp-python "
        f"{summary['in_process_over_phi4_at_last_turn']}x.",
    ]
    table = "\n".join(lines)
    (args.out / f"{name}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
