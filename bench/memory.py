"""The memory-planned engine against baselines measured in the same run, on this machine.

    python bench/memory.py [--model PATH] [--problems 8] [--tokens 2000] [--n-ctx 4096]
                           [--depth 4000] [--chat-tokens 2000] [--skip ...]

1. long thinking under concurrency: N problems of T generated tokens each (the tiny reasoning
   model never stops early, so each is as long as its budget) through an n_ctx that holds only a
   few at once, sent together with `phi4 solve --file`, against the same N one after another;
   and how many came back cancelled (before reservations: most of them);
2. decode tokens/s at a depth of 100 and of --depth prompt tokens, f16 against q8_0 KV cache,
   phi4's daemon against the same llama.cpp run directly (in-process llama-cpp-python, same
   threads, same cache type and flash-attention setting);
3. an evicted chat of --chat-tokens tokens: its next turn restored from disk against re-read.

Without --model, part 1 uses the tiny reasoning test model; parts 2 and 3 want a real-sized
model (`python bench/shaped_model.py` builds one with Phi-4-mini's shapes).
Writes bench/results/memory-<model>.json and .md, and prints the Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PHI4 = [sys.executable, "-m", "phi4cli"]
FILLER = "The quick brown fox jumps over the lazy dog while counting prime numbers. "


def phi4(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PHI4, *args],
        env=env,
        capture_output=True,
        text=True,
        check=check,
        stdin=subprocess.DEVNULL,
    )


def fresh_home() -> dict[str, str]:
    home = tempfile.mkdtemp(prefix="p4m-", dir="/tmp")
    return {**os.environ, "PHI4_HOME": home}


# --- 1. long thinking under concurrency --------------------------------------------------------


def long_thinking(model: Path, problems: int, tokens: int, n_ctx: int) -> dict[str, Any]:
    env = fresh_home()
    phi4(env, "daemon", "start", "-m", str(model), "--n-ctx", str(n_ctx))
    questions = [f"What is {n} times 12?" for n in range(1, problems + 1)]
    listing = Path(env["PHI4_HOME"]) / "problems.txt"
    listing.write_text("".join(f"{q}\n" for q in questions))
    common = ["-m", str(model), "-t", "0.8", "-n", str(tokens), "--seed", "1"]
    started = time.monotonic()
    out = phi4(env, "solve", *common, "--file", str(listing), "--jsonl", check=False)
    together_s = time.monotonic() - started
    records = [json.loads(line) for line in out.stdout.splitlines()]
    started = time.monotonic()
    for question in questions:
        phi4(env, "solve", *common, question, check=False)
    one_by_one_s = time.monotonic() - started
    phi4(env, "stop", check=False)
    return {
        "problems": problems,
        "tokens": tokens,
        "n_ctx": n_ctx,
        "together_s": together_s,
        "one_by_one_s": one_by_one_s,
        "completed": sum(1 for r in records if r.get("error") is None),
        "cancelled": sum(1 for r in records if r.get("error") is not None),
    }


# --- 2. decode rate at depth ---------------------------------------------------------------------

DIRECT = r"""
import json, sys, time
import llama_cpp
model, kv = sys.argv[1], sys.argv[3]
depth, threads, tokens = int(sys.argv[2]), int(sys.argv[4]), int(sys.argv[5])
kind = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}[kv]
llm = llama_cpp.Llama(model, n_ctx=depth + tokens + 64, n_batch=512, n_threads=threads,
                      n_threads_batch=threads, type_k=kind, type_v=kind,
                      flash_attn=True, verbose=False)  # as phi4: on (llama.cpp's CPU default)
text = sys.stdin.read()
prompt = llm.tokenize(text.encode())[:depth]
llm.eval(prompt)
started = time.monotonic()
for _ in range(tokens):
    token = llm.sample(temp=0.0)
    llm.eval([token])
print(json.dumps({"decode_tps": tokens / (time.monotonic() - started)}))
"""


def filler(model: Path, tokens: int) -> str:
    """Text of about ``tokens`` tokens for ``model``'s tokenizer."""
    import llama_cpp

    vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    ids = vocab.tokenize((FILLER * (tokens // 4 + 1)).encode(), add_bos=False)[:tokens]
    return vocab.detokenize(ids).decode(errors="ignore")


def depth_rates(model: Path, depths: list[int], tokens: int, threads: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kv in ("f16", "q8_0"):
        env = fresh_home()
        phi4(
            env,
            "daemon",
            "start",
            "-m",
            str(model),
            "--n-ctx",
            str(max(depths) + 512),
            "--kv-cache-type",
            kv,
            "--parallel",
            "1",
        )
        for depth in depths:
            # Aim the question at `depth` tokens: the daemon's stats say what it really was.
            question = filler(model, depth) + " Summarise."
            stats = json.loads(
                phi4(
                    env, "solve", "-m", str(model), "-t", "0", "-n", str(tokens), "--json", question
                ).stdout
            )["stats"]
            phi4_tps = (stats["completion_tokens"] - 1) / max(stats["decode_s"], 1e-9)
            direct = json.loads(
                subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        DIRECT,
                        str(model),
                        str(stats["prompt_tokens"]),
                        kv,
                        str(threads),
                        str(tokens),
                    ],
                    input=filler(model, depth * 2),
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )
            results[f"{kv}@{depth}"] = {
                "depth": stats["prompt_tokens"],
                "phi4_tps": phi4_tps,
                "direct_tps": direct["decode_tps"],
            }
        phi4(env, "stop", check=False)
    return results


# --- 3. an evicted chat: restored vs re-read --------------------------------------------------


def crowd(connection: Any, max_tokens: int) -> None:
    """Admit a request reserving ``max_tokens`` (which reclaims idle cells), then cancel it once
    it answers: its reservation did the work, its generation would only take time."""
    request_id = connection.send("solve", {"prompt": "Go on.", "max_tokens": max_tokens})
    while True:
        event = connection.next_event()
        if event.id == request_id and event.kind in ("token", "reasoning"):
            connection.send("cancel", {"target": request_id})
        if event.id == request_id and event.terminal:
            return


def chat_restore(model: Path, chat_tokens: int) -> dict[str, Any]:
    from phi4cli.backends.daemon_link import DaemonConnection

    env = fresh_home()
    n_ctx = chat_tokens + 1024
    phi4(env, "daemon", "start", "-m", str(model), "--n-ctx", str(n_ctx))
    home = Path(env["PHI4_HOME"])
    message = filler(model, chat_tokens) + " What is the last word?"

    def turn(connection: Any, session: str, text: str, history: list[dict[str, str]]) -> Any:
        events = list(
            connection.request(
                "chat",
                {
                    "session": session,
                    "message": text,
                    "history": history,
                    "temperature": 0,
                    "max_tokens": 8,
                },
            )
        )
        # What the daemon keeps as the assistant turn: the answer, not the thinking.
        answer = "".join(e.text for e in events if e.kind == "token")
        if events[-1].kind != "done":
            raise SystemExit(f"chat turn failed: {events[-1]}")
        return answer, next(e.stats.to_dict() for e in events if e.kind == "stats")

    try:
        with DaemonConnection.open(home / "run" / "daemon.sock") as connection:
            answer, first = turn(connection, "swap", message, [])
            history = [
                {"role": "user", "content": message},
                {"role": "assistant", "content": answer},
            ]
            # Other work reserves nearly every cell, so the chat's are reclaimed (saved to disk).
            crowd(connection, n_ctx - 200)
            started = time.monotonic()
            _, restored = turn(connection, "swap", "And the first?", history)
            restored_s = time.monotonic() - started
            # The same conversation under a session the daemon has never seen: read anew.
            crowd(connection, n_ctx - 200)
            started = time.monotonic()
            _, reread = turn(connection, "fresh", "And the first?", history)
            reread_s = time.monotonic() - started
    finally:
        phi4(env, "stop", check=False)
    return {
        "chat_tokens": first["context_used"],
        "restored_tokens": restored["restored_tokens"],
        "restored_eval_tokens": restored["prompt_eval_tokens"],
        "restore_s": restored["restore_s"],
        "restored_first_token_s": restored["first_token_s"],
        "restored_turn_s": restored_s,
        "reread_eval_tokens": reread["prompt_eval_tokens"],
        "reread_first_token_s": reread["first_token_s"],
        "reread_turn_s": reread_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=4000)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--chat-tokens", type=int, default=2000)
    parser.add_argument("--skip", nargs="*", default=[], choices=["long", "depth", "chat"])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    from phi4cli.core.machine import physical_cores

    threads = physical_cores()
    model = args.model
    if model is None:
        from tests.tinymodel import write_tiny_phi3

        model = write_tiny_phi3(
            Path(tempfile.mkdtemp()) / "tiny-reasoning.gguf", name="tiny-reasoning-test"
        )
    results: dict[str, Any] = {
        "model": str(model),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {threads} threads",
    }
    lines: list[str] = []
    if "long" not in args.skip:
        r = results["long_thinking"] = long_thinking(model, args.problems, args.tokens, args.n_ctx)
        lines += [
            f"Long thinking on {model.name} ({results['machine']}): {r['problems']} problems x "
            f"{r['tokens']} tokens through n_ctx {r['n_ctx']}",
            "",
            "| run | wall time | completed | cancelled |",
            "| --- | --- | --- | --- |",
            f"| together (`--file`) | {r['together_s']:.1f} s "
            f"| {r['completed']} | {r['cancelled']} |",
            f"| one after another | {r['one_by_one_s']:.1f} s | {r['problems']} | 0 |",
            "",
            f"together / one after another: **{r['together_s'] / r['one_by_one_s']:.2f}x** "
            "the time",
            "",
        ]
    if "depth" not in args.skip:
        rates = results["depth"] = depth_rates(
            model, [100, args.depth], args.decode_tokens, threads
        )
        lines += [
            f"Decode rate by depth on {model.name} ({results['machine']}, "
            f"{args.decode_tokens}-token greedy decode)",
            "",
            "| KV cache | depth | phi4 | llama.cpp direct | ratio |",
            "| --- | --- | --- | --- | --- |",
            *[
                f"| {key.split('@')[0]} | {v['depth']} | {v['phi4_tps']:.2f} tok/s | "
                f"{v['direct_tps']:.2f} tok/s | **{v['phi4_tps'] / v['direct_tps']:.2f}x** |"
                for key, v in rates.items()
            ],
            "",
        ]
    if "chat" not in args.skip:
        c = results["chat"] = chat_restore(model, args.chat_tokens)
        lines += [
            f"An evicted chat of {c['chat_tokens']} tokens, next turn, on {model.name}",
            "",
            "| how | prompt tokens read | time to first token | ratio |",
            "| --- | --- | --- | --- |",
            f"| restored from disk ({c['restore_s'] * 1000:.0f} ms to load the state) | "
            f"{c['restored_eval_tokens']} | "
            f"{c['restored_first_token_s'] * 1000:.0f} ms | **"
            f"{c['reread_first_token_s'] / c['restored_first_token_s']:.1f}x** faster |",
            f"| re-read | {c['reread_eval_tokens']} | {c['reread_first_token_s'] * 1000:.0f} ms"
            " | |",
            "",
        ]
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    parts = [part for part in ("long", "depth", "chat") if part not in args.skip]
    name = f"memory-{model.stem}" + ("" if len(parts) == 3 else "-" + "-".join(parts))
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=2))
    (args.out / f"{name}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
