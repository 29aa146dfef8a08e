"""Exact self-speculation, measured: what drafts would save, what verifying costs, what it gives.

    python bench/speculation.py [--replay] [--cost MODEL ...] [--speed MODEL]
                                [--server PATH/TO/llama-server] [--tokens 192] [--rounds 3]

``--replay`` (no model needed): the real-trace corpus (``tests/data/real_traces``, its 29 traces
that do not loop), each trace's thinking emitted after its problem as teacher-forced
verification steps: tokens per step and the share of drafted tokens kept, for phi4's drafter
(``phi4cli/daemon/llama/speculation.py``: the longest ending of up to 5 tokens) and for the
simplest one (up to 3 tokens, the text alone: prompt-lookup decoding), drafts of 4 and 8, from
the text alone and with siblings (the other traces of the same problem, grown in lockstep: other
models' samples, a lower bound for the same model's). The drafter was chosen on the dev half
(against a most-frequent-next-token chain and shorter endings); the test half is the hold-out.
Tokens: SmolLM2's tokenizer (49,152 pieces; Phi-4-mini's 200,064-piece tokenizer is not on this
machine), which cuts words finer, so these rates run higher than with Phi-4-mini's.

``--cost MODEL``: one ``llama_decode`` of n tokens of one sequence (64 tokens deep) against one
of 1 token, in-process llama-cpp-python on all physical cores, median of 7: the price of
verifying n-1 drafts on this machine.

``--speed MODEL``: the daemon's greedy answer of ``--tokens`` tokens to two questions (counting
in words; a story, which SmolLM2 at temperature 0 soon repeats), with ``speculate`` off, auto
and on, interleaved rounds; completion tokens/s from its own stats, and the drafts kept. With
``--server``, llama-server on the same model and question with each of its draftless
speculation modes (``--spec-type``), tokens/s and drafts kept from its timings.

Writes bench/results/speculation.md (and .json) and prints it.
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
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.speed import PHI4  # noqa: E402
from phi4cli.daemon.llama import speculation as spec  # noqa: E402
from phi4cli.daemon.llama.prompt_cache import common_prefix  # noqa: E402

CORPUS = ROOT / "tests" / "data" / "real_traces" / "traces.jsonl"
QUESTIONS = {
    "counting": "Count from one to one hundred in words, one number per line.",
    "story": "Write a long story about a lighthouse keeper and the sea.",
}
SPEC_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")


# --- the replay ---------------------------------------------------------------------------------


def simple_replay(tokens: list[int], start: int, k: int) -> tuple[int, int, int, int]:
    """Teacher-forced steps with the simplest drafter: the most recent earlier occurrence of the
    sequence's last 3 (else 2, else 1) tokens, and the tokens after it, up to k (of those known
    by then)."""
    last: dict[tuple[int, ...], int] = {}  # n-gram -> where its most recent occurrence ended

    def index(end: int) -> None:
        for n in (1, 2, 3):
            if end >= n:
                last[tuple(tokens[end - n : end])] = end

    for end in range(1, start):  # (not the sequence's own end: that is what is looked up)
        index(end)
    position, steps, drafted, accepted = start, 0, 0, 0
    while position < len(tokens):
        limit = min(k, len(tokens) - position - 1)
        draft: list[int] = []
        for n in (3, 2, 1):
            at = last.get(tuple(tokens[position - n : position]))
            if at is not None:
                draft = tokens[at : min(at + limit, position)]
                break
        right = common_prefix(draft, tokens[position : position + len(draft)])
        for end in range(position, position + right + 1):
            index(end)
        position += right + 1
        steps += 1
        drafted += len(draft)
        accepted += right
    return len(tokens) - start, steps, drafted, accepted


def replay_corpus() -> list[dict[str, Any]]:
    import llama_cpp

    from phi4cli.core.models import resolve_model
    from phi4cli.core.paths import get_paths

    vocab = llama_cpp.Llama(
        str(resolve_model("smollm2-135m", get_paths())), vocab_only=True, verbose=False
    )

    def tokens(text: str) -> list[int]:
        return list(vocab.tokenize(text.encode(), add_bos=False, special=False))

    rows = [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]
    traces = [
        (row, tokens(row["problem"]), tokens(row["thinking"])) for row in rows if not row["loop"]
    ]
    results = []
    for split in ("dev", "test"):
        chosen = [t for t in traces if t[0]["split"] == split]
        for drafter in ("simple", "phi4"):
            for siblings in (False, True):
                if drafter == "simple" and siblings:
                    continue
                for k in (4, 8):
                    emitted = steps = drafted = accepted = 0
                    for row, problem, thinking in chosen:
                        sequence = problem + thinking
                        if drafter == "simple":
                            counts = simple_replay(sequence, len(problem), k)
                        else:
                            others = [
                                p + t
                                for r, p, t in traces
                                if siblings and r is not row and r["dataset"] == row["dataset"]
                            ]
                            counts = spec.replay(sequence, len(problem), k, others)
                        emitted += counts[0]
                        steps += counts[1]
                        drafted += counts[2]
                        accepted += counts[3]
                    results.append(
                        {
                            "split": split,
                            "drafter": drafter,
                            "siblings": siblings,
                            "k": k,
                            "traces": len(chosen),
                            "tokens": emitted,
                            "tokens_per_step": round(emitted / steps, 3),
                            "kept": round(accepted / drafted, 3) if drafted else 0.0,
                        }
                    )
                    print(results[-1], flush=True)
    return results


# --- the cost of verifying ----------------------------------------------------------------------

COST = r"""
import json, statistics, sys, time
import llama_cpp
from llama_cpp import _internals
model_path, threads = sys.argv[1], int(sys.argv[2])
llama_cpp.llama_backend_init()
model = _internals.LlamaModel(path_model=model_path, params=llama_cpp.llama_model_default_params(),
                              verbose=False)
params = llama_cpp.llama_context_default_params()
params.n_ctx, params.n_batch, params.n_threads, params.n_threads_batch = 1024, 512, threads, threads
ctx = _internals.LlamaContext(model=model, params=params, verbose=False)
batch = _internals.LlamaBatch(n_tokens=512, embd=0, n_seq_max=1, verbose=False)
prompt = [(i * 7919) % 1000 + 10 for i in range(64)]
batch.set_batch(prompt, n_past=0, logits_all=False)
ctx.decode(batch)
mem = llama_cpp.llama_get_memory(ctx.ctx)
out = {}
for n in (1, 2, 3, 5, 9, 17):
    times = []
    for _ in range(7):
        batch.set_batch(prompt[:n], n_past=64, logits_all=True)
        started = time.perf_counter()
        ctx.decode(batch)
        times.append(time.perf_counter() - started)
        llama_cpp.llama_memory_seq_rm(mem, 0, 64, -1)
    out[n] = statistics.median(times)
print(json.dumps(out))
"""


def decode_cost(model: Path) -> dict[str, float]:
    from phi4cli.core.machine import physical_cores

    done = subprocess.run(
        [sys.executable, "-c", COST, str(model), str(physical_cores())],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds = {int(n): s for n, s in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    return {str(n): round(s / seconds[1], 2) for n, s in seconds.items()} | {
        "one_token_ms": round(seconds[1] * 1000, 1)
    }


# --- speed, on and off --------------------------------------------------------------------------


def daemon_answer(home: Path, question: str, tokens: int) -> dict[str, Any]:
    from bench.decode import daemon_stats

    stats = daemon_stats(home, question, tokens)
    return {
        "tok_s": (stats.completion_tokens - 1) / stats.decode_s,
        "drafted": stats.draft_tokens,
        "kept": stats.draft_accepted,
    }


def daemon_speeds(model: Path, tokens: int, rounds: int) -> list[dict[str, Any]]:
    from bench.harness import start_daemon

    homes = {}
    for mode in ("off", "auto", "on"):
        home = Path(tempfile.mkdtemp(prefix=f"p4spec-{mode}-", dir="/tmp"))
        env = {**os.environ, "PHI4_HOME": str(home), "PHI4_SPECULATE": mode}
        start_daemon(model, env, ["--parallel", "1"])
        daemon_answer(home, "Hello.", 8)  # (its first request allocates buffers)
        homes[mode] = (home, env)
    rows = []
    try:
        for name, question in QUESTIONS.items():
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in homes}
            for round_ in range(rounds):
                order = list(homes) if round_ % 2 == 0 else list(reversed(homes))
                for mode in order:
                    runs[mode].append(daemon_answer(homes[mode][0], question, tokens))
            off = statistics.median(r["tok_s"] for r in runs["off"])
            for mode, measured in runs.items():
                rate = statistics.median(r["tok_s"] for r in measured)
                rows.append(
                    {
                        "question": name,
                        "engine": f"phi4 speculate {mode}",
                        "tok_s": round(rate, 2),
                        "vs_off": round(rate / off, 3),
                        "drafted": measured[-1]["drafted"],
                        "kept": measured[-1]["kept"],
                    }
                )
                print(rows[-1], flush=True)
    finally:
        for _home, env in homes.values():
            subprocess.run([*PHI4, "stop"], env=env, capture_output=True, check=False)
    return rows


def server_speeds(server: Path, model: Path, tokens: int, rounds: int) -> list[dict[str, Any]]:
    from bench.batching import llama_server_running
    from phi4cli.core.machine import physical_cores

    rows = []
    threads = str(physical_cores())
    for spec_type in SPEC_TYPES:
        args = ["-t", threads, "-tb", threads, "-np", "1", "-c", "4096"]
        if spec_type != "none":
            args += ["--spec-type", spec_type]
        with llama_server_running(server, model, args) as port:
            for name, question in QUESTIONS.items():
                rates, drafted, kept = [], 0, 0
                for _ in range(rounds):
                    body = {
                        "messages": [{"role": "user", "content": question}],
                        "max_tokens": tokens,
                        "temperature": 0,
                        "cache_prompt": False,
                    }
                    request = urllib.request.Request(
                        f"http://127.0.0.1:{port}/v1/chat/completions",
                        json.dumps(body).encode(),
                        {"Content-Type": "application/json"},
                    )
                    with urllib.request.urlopen(request, timeout=3600) as reply:
                        timings = json.loads(reply.read())["timings"]
                    rates.append(timings["predicted_per_second"])
                    drafted = timings.get("draft_n", 0)
                    kept = timings.get("draft_n_accepted", 0)
                rows.append(
                    {
                        "question": name,
                        "engine": f"llama-server {spec_type}",
                        "tok_s": round(statistics.median(rates), 2),
                        "drafted": drafted,
                        "kept": kept,
                    }
                )
                print(rows[-1], flush=True)
    return rows


# --- the report ---------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    lines = [f"# Speculation ({results['date']}, {results['machine']})", ""]
    if results.get("replay"):
        lines += [
            "## Replay on the real-trace corpus (tokens per verification step; drafted "
            "tokens kept)",
            "",
            "| split | drafter | siblings | k | traces | tokens | tokens/step | kept |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in results["replay"]:
            lines.append(
                f"| {r['split']} | {r['drafter']} | {'yes' if r['siblings'] else 'no'} "
                f"| {r['k']} | {r['traces']} | {r['tokens']:,} | "
                f"{r['tokens_per_step']:.3f} | {r['kept']:.0%} |"
            )
        lines.append("")
    for model, cost in (results.get("cost") or {}).items():
        lines += [
            f"## One decode of n tokens of one sequence against 1 ({model}; 1 token "
            f"{cost['one_token_ms']} ms)",
            "",
            "| n | " + " | ".join(k for k in cost if k != "one_token_ms") + " |",
            "| --- |" + " --- |" * (len(cost) - 1),
            "| cost | "
            + " | ".join(f"{v}x" for k, v in cost.items() if k != "one_token_ms")
            + " |",
            "",
        ]
    if results.get("speed"):
        lines += [
            f"## Greedy answers of {results['tokens']} tokens ({results['speed_model']}, "
            f"median of {results['rounds']} interleaved rounds)",
            "",
            "| question | engine | tokens/s | against off | drafted | kept |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in results["speed"]:
            against = f"{r['vs_off']:.3f}x" if "vs_off" in r else "-"
            lines.append(
                f"| {r['question']} | {r['engine']} | {r['tok_s']} | {against} | "
                f"{r['drafted']} | {r['kept']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replay", action="store_true")
    parser.add_argument("--cost", type=Path, nargs="*", default=[])
    parser.add_argument("--speed", type=Path)
    parser.add_argument("--server", type=Path)
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()}-core {platform.machine()}",
        "tokens": args.tokens,
        "rounds": args.rounds,
    }
    if args.replay:
        results["replay"] = replay_corpus()
    if args.cost:
        results["cost"] = {path.name: decode_cost(path) for path in args.cost}
    if args.speed:
        results["speed_model"] = args.speed.name
        results["speed"] = daemon_speeds(args.speed, args.tokens, args.rounds)
        if args.server:
            results["speed"] += server_speeds(args.server, args.speed, args.tokens, args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculation.json").write_text(json.dumps(results, indent=1) + "\n")
    text = report(results)
    (args.out / "speculation.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
